"""Checkpoints that never half-exist and never run code when loaded.

Lightning stages a checkpoint in `$TMPDIR` and moves it into place without fsync, which is a
copy (not an atomic rename) across file systems and can lose the file on power loss. Here a
checkpoint is written next to its final path, flushed to disk, then renamed over it, so a kill
or a full disk during a save leaves the previous checkpoint intact. Every load is
`weights_only=True`, with errors that say what was wrong with the file.
"""

import errno
import shutil
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO

from src.utils.errors import CheckpointError, cause_chain
from src.utils.files import write_atomically
from src.utils.weights import load_checkpoint

# A write that fails for want of space: a full disk, or the user's quota used up.
FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


def save_atomically(checkpoint: dict[str, Any], path: str | Path) -> None:
    """torch.save to a temporary file in the same folder, fsync, rename over `path`."""
    try:
        write_atomically(path, lambda file: torch.save(checkpoint, file), what="checkpoint")
    except (OSError, RuntimeError) as error:
        if not caused_by_full_disk(error):
            raise
        raise disk_full(Path(path), checkpoint) from error


def caused_by_full_disk(error: BaseException) -> bool:
    """Tell whether a full disk lies anywhere in `error`'s cause chain.

    torch.save reports one as a RuntimeError ("unexpected pos"), the OSError only in its context.
    """
    return any(isinstance(e, OSError) and e.errno in FULL_DISK for e in cause_chain(error))


def disk_full(path: Path, checkpoint: dict[str, Any]) -> CheckpointError:
    free = shutil.disk_usage(path.parent).free
    return CheckpointError(
        f"No space left on the device: saving the checkpoint {path} needed about "
        f"{size_in_words(tensor_bytes(checkpoint))}, and {size_in_words(free)} is free there. The "
        f"previous checkpoint at that path (if any) is intact. Free some space and resume with "
        f"ckpt_path=last, or write the run elsewhere (hydra.run.dir=...)."
    )


def tensor_bytes(value: Any) -> int:
    """The bytes of every tensor in a nested checkpoint: about its size on disk."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, dict):
        return sum(tensor_bytes(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(item) for item in value)
    return 0


def size_in_words(size: float) -> str:
    """1234567 -> "1.2 MB"."""
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000:
            return f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


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
