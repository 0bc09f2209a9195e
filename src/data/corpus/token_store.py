"""A tokenised corpus on disk, memory-mapped.

It holds the token ids of every document back to back, where each document starts, and (for SFT)
which tokens are training targets.

A store is a folder `store-<key>` holding

- `tokens.bin`: the ids, in the smallest unsigned dtype that holds the vocabulary;
- `offsets.bin`: int64, document i is tokens[offsets[i]:offsets[i + 1]];
- `targets.bin` (SFT only): uint8, 1 where a token is a training target;
- `manifest.json`: the key, the dtype, the counts and each file's size and xxh3-64 checksum.

Readers map the files and never copy them, so a run holds no token in Python objects; training
rows are read by position (`TokenStore.read`). A store is built in a staging folder and renamed into
place once complete, so readers see a whole store or none; on opening, every size and checksum
is compared with the manifest, and a store that does not match (truncated, corrupt, or another
key's) is rebuilt rather than read. Staging folders left by killed builders on this host are
removed by the next build.
"""

import errno
import json
import logging
import os
import re
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

from src.utils.errors import DataError
from src.utils.files import (
    PositionalReader,
    fsync_folder,
    hash_file,
    is_alive,
    write_atomically,
)

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: xxh3-64 checksums instead of CRC-32


class StoreMismatch(Exception):
    """A store folder that is not the complete store its manifest describes."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint8 for at most 256 ids, uint16 up to 65,536, else uint32."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise DataError(f"A vocabulary of {vocab_size} ids does not fit 32-bit token ids")


class TokenStore:
    """The memory-mapped arrays of one store; see the module docstring."""

    def __init__(self, folder: Path, manifest: dict):
        self.folder = folder
        self.manifest = manifest
        self.tokens = _map(folder / "tokens.bin", manifest["dtype"])
        self.offsets = _map(folder / "offsets.bin", "int64")
        self.targets = _map(folder / "targets.bin", "uint8") if manifest["has_targets"] else None
        self._readers: dict[str, PositionalReader] = {}

    @classmethod
    def open(cls, folder: Path, key: str) -> "TokenStore":
        """The store in `folder`, after checking it is whole and is the store of `key`."""
        try:
            manifest = json.loads((folder / "manifest.json").read_text())
        except (OSError, ValueError) as error:
            raise StoreMismatch(f"no readable manifest ({error})") from None
        try:
            if manifest["format"] != FORMAT_VERSION or manifest["key"] != key:
                raise StoreMismatch(f"written for {manifest['key']!r}, not {key!r}")
            for name, expected in manifest["files"].items():
                path = folder / name
                if not path.is_file() or path.stat().st_size != expected["bytes"]:
                    raise StoreMismatch(f"{name} is not {expected['bytes']} bytes long")
                if _checksum(path) != expected["xxh3_64"]:
                    raise StoreMismatch(f"{name} does not match its checksum")
            return cls(folder, manifest)
        except (KeyError, TypeError, AttributeError) as error:
            raise StoreMismatch(f"a malformed manifest ({error!r})") from None

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def part_documents(self) -> list[int]:
        """How many documents each part holds, in order: a data mixture's sources, else one."""
        return self.manifest.get("part_documents", [self.num_documents])

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def read(self, begin: int, end: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Tokens [begin, end) and their target flags (None without targets).

        They are read from the files rather than through the maps (see `PositionalReader`).
        """
        tokens = self._read("tokens.bin", begin, end, self.tokens.dtype)
        if self.targets is None:
            return tokens, None
        return tokens, self._read("targets.bin", begin, end, self.targets.dtype)

    def _read(self, name: str, begin: int, end: int, dtype: np.dtype) -> np.ndarray:
        if name not in self._readers:
            self._readers[name] = PositionalReader(self.folder / name)
        data = self._readers[name].read(begin * dtype.itemsize, (end - begin) * dtype.itemsize)
        return np.frombuffer(data, dtype=dtype)

    def __getstate__(self) -> dict:
        """A spawned worker maps the folder again rather than receiving copies of the maps."""
        return {"folder": self.folder, "manifest": self.manifest}

    def __setstate__(self, state: dict) -> None:
        TokenStore.__init__(self, state["folder"], state["manifest"])


class StoreWriter:
    """Appends documents to the files of a new store in `folder`, then writes its manifest."""

    def __init__(self, folder: Path, key: str, vocab_size: int, has_targets: bool):
        folder.mkdir(parents=True)
        self.folder, self.key = folder, key
        self.dtype = token_dtype(vocab_size)
        self.files = {"tokens.bin": (folder / "tokens.bin").open("wb")}
        if has_targets:
            self.files["targets.bin"] = (folder / "targets.bin").open("wb")
        self.checksums = {name: xxhash.xxh3_64() for name in [*self.files, "offsets.bin"]}
        self.lengths: list[np.ndarray] = []  # one small array per batch of documents

    def add(self, tokens: np.ndarray, lengths: np.ndarray, targets: np.ndarray | None = None):
        """Documents whose tokens (and targets) are back to back in `tokens`, `lengths` long."""
        self._write("tokens.bin", tokens.astype(self.dtype, copy=False))
        if "targets.bin" in self.files:
            assert targets is not None, "a store with targets takes them with every batch"
            self._write("targets.bin", targets.astype(np.uint8, copy=False))
        self.lengths.append(lengths.astype(np.int64, copy=False))

    def finish(self, **info) -> None:
        lengths = np.concatenate(self.lengths or [np.zeros(0, np.int64)])
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        self.files["offsets.bin"] = (self.folder / "offsets.bin").open("wb")
        self._write("offsets.bin", offsets)
        files = {}
        for name, file in self.files.items():
            file.flush()
            os.fsync(file.fileno())
            file.close()
            size = (self.folder / name).stat().st_size
            files[name] = {"bytes": size, "xxh3_64": self.checksums[name].hexdigest()}
        manifest = {
            "format": FORMAT_VERSION,
            "key": self.key,
            "dtype": self.dtype.name,
            "has_targets": "targets.bin" in files,
            "documents": len(lengths),
            "tokens": int(offsets[-1]),
            "files": files,
            **info,
        }
        write_atomically(self.folder / "manifest.json", json.dumps(manifest, indent=2).encode())

    def _write(self, name: str, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array).data
        self.files[name].write(data)
        self.checksums[name].update(data)


def load_or_build(
    cache_dir: Path, key: str, build: Callable[[Path], None], what: str = "corpus"
) -> TokenStore:
    """The store of `key` in `cache_dir`, else `build(staging folder)` renamed into place.

    A store that does not match its manifest is logged and rebuilt. Running out of disk while
    building leaves every existing store as it was.
    """
    folder = cache_dir / f"store-{key}"
    remove_stale_staging(cache_dir)
    if folder.exists():
        try:
            return TokenStore.open(folder, key)
        except StoreMismatch as reason:
            log.warning("The token store %s is unusable (%s): building it again", folder, reason)
    cache_dir.mkdir(parents=True, exist_ok=True)
    builder = builder_name()
    staging = cache_dir / f".store-{key}.tmp-{builder}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        build(staging)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            raise DataError(
                f"No space left on the device while tokenising the {what} into {folder}; the "
                f"stores already in {cache_dir} are intact. Free space or set data.cache_dir "
                f"to another disk"
            ) from None
        raise
    replaced = cache_dir / f".store-{key}.old-{builder}"
    if folder.exists():
        folder.rename(replaced)
    os.replace(staging, folder)
    fsync_folder(cache_dir)
    shutil.rmtree(replaced, ignore_errors=True)
    return TokenStore.open(folder, key)


def builder_name() -> str:
    """This process on this host: the suffix of the staging folders it writes.

    The host is in it because nodes may share the cache folder.
    """
    return f"{socket.gethostname()}-{os.getpid()}"


def remove_stale_staging(cache_dir: Path) -> None:
    """Remove the staging and work folders that killed builders on this host left.

    Those are the folders whose process is gone. Other hosts' folders are left alone.
    """
    host = re.escape(socket.gethostname())
    pattern = re.compile(rf"\.(?:store-\w+\.(?:tmp|old)|work)-{host}-(\d+)(?:\..*)?")
    for entry in cache_dir.iterdir() if cache_dir.is_dir() else ():
        match = pattern.fullmatch(entry.name)
        if match and not is_alive(match.group(1)):
            log.info("Removing %s, left by a killed build", entry)
            shutil.rmtree(entry, ignore_errors=True)


def _map(path: Path, dtype: str) -> np.ndarray:
    if path.stat().st_size == 0:  # numpy cannot map an empty file
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def _checksum(path: Path) -> str:
    digest = xxhash.xxh3_64()
    hash_file(digest, path)
    return digest.hexdigest()
