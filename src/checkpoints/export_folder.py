"""The folder an export writes into: never over an earlier export unless told, one file mode.

Every export writes `config.yaml` beside its weights, so a folder holding one (or any weights or
tokenizer file an export writes) holds an earlier export. The weights writers (safetensors' own
atomic save among them) create files readable by their owner alone; the files an export writes
get the mode the user's umask gives every other file of a run.
"""

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from src.utils.errors import ConfigError

# What the formats write (scripts/export.py): the weights file, a transformers folder (weights
# whole or sharded), a peft folder; the config and the tokenizer of every format.
EXPORT_NAMES = (
    "config.yaml",
    "model.safetensors",
    "model.pt",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
    "config.json",
    "tokenizer",
    "tokenizer.json",
    "tokenizer_config.json",
    "adapter_config.json",
    "adapter_model.safetensors",
)


def check_no_earlier_export(folder: Path, overwrite: bool) -> None:
    """Refuse to export into `folder` when it holds an earlier export, unless `overwrite`."""
    earlier = sorted({path.name for pattern in EXPORT_NAMES for path in folder.glob(pattern)})
    if earlier and not overwrite:
        raise ConfigError(
            f"{folder} already holds an export ({', '.join(earlier)}): export into another "
            f"folder (hydra.run.dir=<new folder>, or leave it out for a new one), or pass "
            f"overwrite=true to write over it."
        )


@contextmanager
def with_one_file_mode(folder: Path) -> Iterator[None]:
    """Give every file written or replaced in `folder` meanwhile the mode of the user's umask."""
    before = file_stamps(folder)
    yield
    mode = default_file_mode()
    for path, stamp in file_stamps(folder).items():
        if before.get(path) != stamp:
            path.chmod(mode)


def file_stamps(folder: Path) -> dict[Path, tuple[int, int]]:
    """Each file under `folder` with its inode and modification time: what a write changes."""
    stamps = {}
    for path in folder.rglob("*"):
        if path.is_file():
            status = path.stat()
            stamps[path] = (status.st_ino, status.st_mtime_ns)
    return stamps


def default_file_mode() -> int:
    """The mode `open(path, "w")` gives a new file: read-write for all, less the umask."""
    umask = os.umask(0)  # reading the umask means setting it: set it straight back
    os.umask(umask)
    return 0o666 & ~umask
