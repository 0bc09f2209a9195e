"""Reference log-probabilities computed once per store and reference, kept in the store's folder.

`data.precompute_ref_logps=true` computes each pair's reference log-probabilities (chosen,
rejected) before training, so that no reference network is held while it trains. They are
written into the token store's folder as `ref-logps-<key>.bin` (float32 [pairs, 2], NaN for
pairs no split keeps) beside `ref-logps-<key>.json` (the key, the size and an xxh3-64
checksum), the key naming the store, the reference weights and how pairs were fitted. A
resumed run finds them there; a file that does not match its manifest is computed again.
"""

import json
import logging
from pathlib import Path

import numpy as np
import xxhash

from src.utils.files import hash_file, write_atomically

log = logging.getLogger(__name__)


def paths(folder: Path, key: str) -> tuple[Path, Path]:
    return folder / f"ref-logps-{key}.bin", folder / f"ref-logps-{key}.json"


def load(folder: Path, key: str, pairs: int) -> np.ndarray | None:
    """The stored values of `key` if they are whole, else None (logged when they are corrupt)."""
    values, manifest = paths(folder, key)
    if not manifest.is_file():
        return None
    try:
        expected = json.loads(manifest.read_text())
        if expected["key"] != key or expected["pairs"] != pairs:
            raise ValueError(f"written for {expected['key']} with {expected['pairs']} pairs")
        if not values.is_file() or values.stat().st_size != expected["bytes"]:
            raise ValueError(f"{values.name} is not {expected['bytes']} bytes long")
        if checksum(values) != expected["xxh3_64"]:
            raise ValueError(f"{values.name} does not match its checksum")
    except (OSError, ValueError, KeyError, TypeError) as reason:
        log.warning(
            "The reference log-probabilities %s are unusable (%s): computing them again",
            values,
            reason,
        )
        return None
    return np.fromfile(values, dtype=np.float32).reshape(pairs, 2)


def save(folder: Path, key: str, values: np.ndarray) -> None:
    """Write `values` [pairs, 2] and then their manifest, each atomically."""
    path, manifest = paths(folder, key)
    data = np.ascontiguousarray(values, dtype=np.float32).tobytes()
    write_atomically(path, data, what="reference log-probabilities")
    record = {"key": key, "pairs": len(values), "bytes": len(data), "xxh3_64": checksum(path)}
    write_atomically(manifest, json.dumps(record, indent=2).encode(), what="manifest")


def checksum(path: Path) -> str:
    digest = xxhash.xxh3_64()
    hash_file(digest, path)
    return digest.hexdigest()
