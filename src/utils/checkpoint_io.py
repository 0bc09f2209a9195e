"""Checkpoints that never half-exist and never run code when loaded.

Lightning stages a checkpoint in `$TMPDIR` and moves it into place without fsync, which is a
copy (not an atomic rename) across file systems and can lose the file on power loss. Here a
checkpoint is written next to its final path, flushed to disk, then renamed over it, so a kill
or a full disk during a save leaves the previous checkpoint intact. Every load is
`weights_only=True`, with errors that say what was wrong with the file.
"""

import errno
import os
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch
from lightning.fabric.plugins import TorchCheckpointIO

from src.utils.errors import CheckpointError, MissingFileError


def save_atomically(checkpoint: dict[str, Any], path: str | Path) -> None:
    """torch.save to a temporary file in the same folder, fsync, rename over `path`."""
    write_atomically(path, lambda file: torch.save(checkpoint, file), what="checkpoint")


def write_atomically(
    path: str | Path, write: Callable[[BinaryIO], None] | bytes, what: str = "file"
) -> None:
    """Write `path` through a temporary file in the same folder, fsync, rename: readers see the
    previous content or the new one, never a part. `write` is the bytes or fills the file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):  # left by a process killed mid-save
        stale.unlink(missing_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with temporary.open("wb") as file:
            if isinstance(write, bytes):
                file.write(write)
            else:
                write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        temporary.unlink(missing_ok=True)
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            raise CheckpointError(
                f"No space left on the device while writing {path}; the previous {what} "
                f"there (if any) is intact. Free space or point the run elsewhere "
                f"(hydra.run.dir=...)."
            ) from error
        raise
    _fsync_folder(path.parent)


def load_checkpoint(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    """torch.load with `weights_only=True`: tensors and plain Python values, never code."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"Checkpoint {str(path)!r} does not exist.")
    try:
        # mmap: a large checkpoint is paged in as read, not copied into memory up front.
        return torch.load(path, map_location=map_location, weights_only=True, mmap=True)
    except RuntimeError as error:
        if "mmap" not in str(error):  # only files in the legacy (non-zip) format need this
            raise _corrupt(path, error) from None
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        reason = str(error).split("\n")[0]
        raise CheckpointError(
            f"Refusing to load {path}: it holds pickled Python objects, not only tensors and "
            f"plain values ({reason}). Unpickling them could run arbitrary code. If you trust "
            f"the file's origin, re-save its tensors (e.g. its state_dict) as .safetensors."
        ) from None
    except (EOFError, zipfile.BadZipFile) as error:
        raise _corrupt(path, error) from None


def _corrupt(path: Path, error: Exception) -> CheckpointError:
    return CheckpointError(
        f"{path} is not a readable checkpoint (truncated or corrupt: "
        f"{str(error).splitlines()[0]}). Use another one, e.g. an earlier checkpoint from the "
        f"same folder."
    )


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


def _fsync_folder(folder: Path) -> None:
    """Persist the rename itself (POSIX); a no-op where folders cannot be opened."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
