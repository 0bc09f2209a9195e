"""Files that never half-exist, and files read by position, without a map.

A file is written beside its final path, flushed, then renamed into place.
"""

import errno
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from src.utils.errors import CheckpointError

log = logging.getLogger(__name__)


def write_atomically(
    path: str | Path, write: Callable[[BinaryIO], None] | bytes, what: str = "file"
) -> None:
    """Write `path` through a temporary file in the same folder, then fsync and rename it.

    Readers see the previous content or the new one, never a part. `write` is the bytes or fills
    the file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):  # left by a process killed mid-save
        if not is_alive(stale.name.rpartition("-")[2]):  # never a save still in progress
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
    fsync_folder(path.parent)


def is_alive(pid: str) -> bool:
    """Whether the process with this id still runs on this machine.

    The id is as written in a temporary file's name; a name that holds no id counts as dead.
    """
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)  # signal 0: only the existence check
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def fsync_folder(folder: Path) -> None:
    """Persist the rename itself (POSIX); a no-op where folders cannot be opened."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def link_atomically(target: str | Path, link: str | Path) -> None:
    """Make `link` a hard link to the file `target`, replacing whatever `link` was in one rename.

    Where the file system has no hard links, `link` is a copy (written atomically).

    A hard link, not a symlink: deleting `target` (a periodic checkpoint rotated out) leaves
    `link` whole instead of dangling, Windows allows it without special rights, and an atomic
    save to `link` (the preemption save) renames a new file over the name, never writing into
    `target`. Copying a run directory keeps both names (`rsync -aH` keeps them one file).
    """
    target, link = Path(target), Path(link)
    temporary = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    temporary.unlink(missing_ok=True)
    try:
        os.link(target, temporary)
    except OSError as error:
        if not target.is_file():
            raise
        log.info("No hard link from %s to %s (%s): writing a copy", link, target, error)
        write_atomically(link, lambda file: copy_into(target, file), what="checkpoint")
        return
    os.replace(temporary, link)
    fsync_folder(link.parent)


def copy_into(source: Path, file: BinaryIO) -> None:
    """Copy the bytes of `source` into the open binary `file`."""
    with source.open("rb") as original:
        shutil.copyfileobj(original, file)


def hash_file(digest, path: Path, chunk_bytes: int = 16 << 20) -> None:
    """Feed the contents of `path` to `digest`, read in chunks into one reused buffer.

    `digest` is anything with `update`, hashlib's or xxhash's.
    """
    buffer = bytearray(chunk_bytes)
    with Path(path).open("rb", buffering=0) as file:
        while count := file.readinto(buffer):
            digest.update(memoryview(buffer)[:count])


class PositionalReader:
    """Byte ranges of a file read with `os.pread`, through a descriptor each process opens once.

    A forked data-loader worker opens its own; the reader is pickled as its path.

    Rather than a memory map: a mapped page counts in the process's resident memory once
    touched, with the kernel's read-ahead around it, and the random rows of an epoch touch
    every page, so a long run would end up holding the whole file. Read, the pages stay in the
    page cache, shared and dropped by the kernel as it needs.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._descriptors: dict[int, int] = {}  # process id -> descriptor

    def read(self, offset: int, size: int) -> bytes:
        descriptor = self._descriptors.get(os.getpid())
        if descriptor is None:
            descriptor = self._descriptors[os.getpid()] = os.open(self.path, os.O_RDONLY)
        return os.pread(descriptor, size, offset)

    def __getstate__(self) -> dict:
        return {"path": self.path, "_descriptors": {}}

    def __del__(self) -> None:
        descriptor = getattr(self, "_descriptors", {}).pop(os.getpid(), None)
        if descriptor is not None:
            os.close(descriptor)
