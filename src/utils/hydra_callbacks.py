"""Hydra callbacks: what must happen before Hydra creates the run directory."""

import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from omegaconf import DictConfig, open_dict, read_write

from src.utils.launch_name import register_launch_name_resolver

# Hydra imports this module in every process that resolves a run or sweep directory, a
# launcher's jobs included (they unpickle these callbacks but never run train.py's top level).
register_launch_name_resolver()


class WritableOutputDir(Callback):
    """Stops with one clear line when the run (or sweep) directory cannot be written."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        check_writable(Path(config.hydra.run.dir), "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        check_writable(Path(config.hydra.sweep.dir), "hydra.sweep.dir")


class RankZeroRunFiles(Callback):
    """Under torchrun or srun every rank runs Hydra in the same run directory: ranks other than
    0 log to `<job>_rank<N>.log` and leave `.hydra/` to rank 0, as Lightning arranges for the
    ranks it starts itself."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        rank = external_launch_rank()
        if rank:
            with read_write(config.hydra), open_dict(config.hydra):
                config.hydra.job.name = f"{config.hydra.job.name}_rank{rank}"
                config.hydra.output_subdir = None


def external_launch_rank() -> int:
    """This process's global rank when torchrun or srun started it, else 0."""
    for environment in (TorchElasticEnvironment, SLURMEnvironment):
        if environment.detect():
            return environment().global_rank()
    return 0


def check_writable(folder: Path, key: str) -> None:
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is not None and existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
        return
    reason = "is not a folder" if existing is not None and not existing.is_dir() else "is read-only"
    raise SystemExit(
        f"Error: cannot create the output directory {folder}: {existing} {reason}. Choose a "
        f"writable place with {key}=... or paths.log_dir=..."
    )
