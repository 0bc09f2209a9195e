"""Hydra callbacks: checks that must run before Hydra creates the run directory."""

import os
import shutil
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from src.run.launch import register_launch_resolvers

# Hydra imports this module in every process that resolves a run or sweep directory, a
# launcher's jobs included (they unpickle these callbacks but never run train.py's top level).
register_launch_resolvers()


# Below this much free space Hydra's own config files may not fit: a run cannot start.
MIN_FREE_BYTES = 1 << 20


class WritableOutputDir(Callback):
    """Stop with one clear line when the run (or sweep) directory cannot be written.

    A read-only place or a full disk; Hydra, writing `.hydra/`, would fail with a traceback.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        check_writable(Path(config.hydra.run.dir), "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        check_writable(Path(config.hydra.sweep.dir), "hydra.sweep.dir")


def check_writable(folder: Path, key: str) -> None:
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is not None and existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
        free = shutil.disk_usage(existing).free
        if free >= MIN_FREE_BYTES:
            return
        raise SystemExit(
            f"Error: no space left on the device holding {folder} ({free / 1024:.0f} kB free "
            f"in {existing}): the run could not even write its config there. Free some space, "
            f"or choose another place with {key}=... or paths.log_dir=..."
        )
    reason = "is not a folder" if existing is not None and not existing.is_dir() else "is read-only"
    raise SystemExit(
        f"Error: cannot create the output directory {folder}: {existing} {reason}. Choose a "
        f"writable place with {key}=... or paths.log_dir=..."
    )
