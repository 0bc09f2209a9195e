"""Checkpoints that never half-exist and never run code when loaded.

Lightning stages a checkpoint in `$TMPDIR` and moves it into place without fsync, which is a
copy (not an atomic rename) across file systems and can lose the file on power loss. Here a
checkpoint is written next to its final path, flushed to disk, then renamed over it, so a kill
or a full disk during a save leaves the previous checkpoint intact. Every load is
`weights_only=True`, with errors that say what was wrong with the file.
"""

from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO

from src.utils.files import write_atomically
from src.utils.weights import load_checkpoint


def save_atomically(checkpoint: dict[str, Any], path: str | Path) -> None:
    """torch.save to a temporary file in the same folder, fsync, rename over `path`."""
    write_atomically(path, lambda file: torch.save(checkpoint, file), what="checkpoint")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint IO with atomic saves and weights-only loads."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        save_atomically(checkpoint, path)

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        return load_checkpoint(path, map_location or "cpu")
