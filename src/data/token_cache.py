"""Tokenised samples cached on disk as safetensors, so a second run skips tokenising.

A cache file holds every sample of a corpus back to back (`tokens` int32, `targets` uint8) and
their `lengths`; its name is a hash of everything that decides its content (the source files,
how they are cut into samples and the tokenizer), so a change to any of them misses the cache
instead of reading stale tokens. safetensors stores tensors only: loading runs no code.
"""

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from src.data.packing import Sample
from src.utils.files import write_atomically

log = logging.getLogger(__name__)

FORMAT_VERSION = "1"


def cache_key(*parts: str) -> str:
    return hashlib.sha256("|".join((FORMAT_VERSION, *parts)).encode()).hexdigest()[:20]


def file_fingerprint(paths: list[Path]) -> str:
    """A hash of the files' names and contents."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(str(path.name).encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def cached_samples(
    cache_dir: Path | None, key: str, tokenize: Callable[[], list[Sample]]
) -> list[Sample]:
    """The samples stored under `key` in `cache_dir`, else `tokenize()` stored there."""
    path = None if cache_dir is None else Path(cache_dir) / f"tokens-{key}.safetensors"
    if path is not None and path.is_file():
        try:
            return _unpack(load_file(path))
        except (SafetensorError, KeyError, OSError) as error:
            log.warning("Unreadable token cache %s (%s): tokenising again", path, error)
    samples = tokenize()
    if path is not None:
        write_atomically(path, save(_flatten(samples)), what="token cache")
        log.info("Cached %d tokenised samples in %s", len(samples), path)
    return samples


def _flatten(samples: list[Sample]) -> dict[str, torch.Tensor]:
    empty = torch.zeros(0, dtype=torch.long)
    return {
        "tokens": torch.cat([s.tokens for s in samples] or [empty]).to(torch.int32),
        "targets": torch.cat([s.targets for s in samples] or [empty.bool()]).to(torch.uint8),
        "lengths": torch.tensor([len(s) for s in samples], dtype=torch.long),
    }


def _unpack(stored: dict[str, torch.Tensor]) -> list[Sample]:
    lengths = stored["lengths"].tolist()
    tokens = stored["tokens"].long().split(lengths)
    targets = stored["targets"].bool().split(lengths)
    return [Sample(t, m) for t, m in zip(tokens, targets, strict=True)]
