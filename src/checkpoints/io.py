"""Checkpoints that never half-exist and never run code when loaded.

Lightning stages a checkpoint in `$TMPDIR` and moves it into place without fsync, which is a
copy (not an atomic rename) across file systems and can lose the file on power loss. Here a
checkpoint is written next to its final path, flushed to disk, then renamed over it, so a kill
or a full disk during a save leaves the previous checkpoint intact. Every load is
`weights_only=True`, with errors that say what was wrong with the file.
"""

import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO

from src.utils.errors import CheckpointError, MissingFileError
from src.utils.files import write_atomically


def save_atomically(checkpoint: dict[str, Any], path: str | Path) -> None:
    """torch.save to a temporary file in the same folder, fsync, rename over `path`."""
    write_atomically(path, lambda file: torch.save(checkpoint, file), what="checkpoint")


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
