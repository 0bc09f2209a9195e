"""Weighted data mixtures (`data.mixture`): several sources, each drawn by its weight.

`data.mixture=[{paths: [...], weight: 0.7}, {paths: [...], weight: 0.3}]` replaces `data.paths`
(`data.path` for SFT). A weight is a source's share of the training rows (of the training
tokens when rows are packed, up to padding); the weights are normalised to sum to 1.

- **Stored** (`MixtureSampler`): an epoch is as many rows as all the sources' training rows
  together, of which source i gives its share, taken from an endless sequence of shuffled
  passes over its own rows. A source weighted below its size shows new rows each epoch until
  its pass ends; one weighted above it repeats its rows within an epoch. The epoch's rows are
  then shuffled together and dealt to ranks like any other split.
- **Streamed** (`MixedStream`): each source is a stream of its own, and the next row comes from
  the source furthest behind its share, so that every stretch of rows holds the weights to
  within one row of each source.

Both resume exactly: the sampler's position is its epoch and the rows it yielded; the mixed
stream's the rows taken from each source and each source's own position.

Written here: torch's `WeightedRandomSampler` draws with replacement and has no state, and
`datasets.interleave_datasets` mixes iterable datasets but not a store's rows by epoch.
"""

import difflib
import glob
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath, PurePosixPath
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from src.data.packing.packing import Sample
from src.data.sampler import ResumableDistributedSampler
from src.data.text.streaming import StreamedRows
from src.utils.errors import ConfigError

ENTRY_KEYS = ("paths", "weight", "name", "val_paths")
NAME = re.compile(r"[A-Za-z0-9_.-]+")
EXAMPLE = "data.mixture=[{paths: [a/], weight: 0.7}, {paths: [b.jsonl], weight: 0.3}]"


@dataclass(frozen=True)
class WeightedSource:
    """One entry of `data.mixture`: its files, its normalised weight and the name it logs under."""

    name: str
    paths: list[str]
    weight: float
    val_paths: list[str] | None = None  # streaming: its held-out files


def parse_mixture(entries: Any, streaming: bool = False) -> list[WeightedSource]:
    """The sources of `data.mixture`, or a ConfigError naming the entry and what is wrong."""
    if not isinstance(entries, Sequence) or isinstance(entries, str) or not entries:
        raise ConfigError(f"data.mixture must be a non-empty list of sources, such as {EXAMPLE}")
    checked = [_checked_entry(entry, index, streaming) for index, entry in enumerate(entries)]
    total = sum(entry["weight"] for entry in checked)
    names = _names(checked)
    return [
        WeightedSource(name, entry["paths"], entry["weight"] / total, entry.get("val_paths"))
        for name, entry in zip(names, checked, strict=True)
    ]


def _checked_entry(entry: Any, index: int, streaming: bool) -> dict[str, Any]:
    where = f"data.mixture[{index}]"
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where} is {entry!r}, not a source such as {{paths: [...], weight: 1}}")
    entry = dict(entry)
    for key in entry:
        if key not in ENTRY_KEYS:
            close = difflib.get_close_matches(str(key), ENTRY_KEYS, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(
                f"{where}.{key} is not a source option: {hint}A source takes {ENTRY_KEYS}"
            )
    if not entry.get("paths"):
        raise ConfigError(
            f"{where} needs paths: the files, globs, folders or hf:// datasets it reads"
        )
    weight = entry.get("weight")
    if (
        isinstance(weight, bool)
        or not isinstance(weight, int | float)
        or not 0 < weight < float("inf")
    ):
        raise ConfigError(f"{where}.weight={weight!r}: give a positive number, the source's share")
    entry["paths"] = as_list(entry["paths"])
    if streaming and not entry.get("val_paths"):
        raise ConfigError(
            f"{where}: with data.streaming=true each source validates on held-out files of its "
            f"own: set {where}.val_paths=[<files, globs or folders>]"
        )
    if not streaming and entry.get("val_paths"):
        raise ConfigError(
            f"{where}.val_paths is for data.streaming=true; a stored source validates on "
            f"data.val_fraction of its own documents: remove it"
        )
    if entry.get("val_paths"):
        entry["val_paths"] = as_list(entry["val_paths"])
    return entry


def as_list(paths: str | PurePath | Sequence[str]) -> list[str]:
    """A path, or a list of them (a config's list node included), as a list of strings."""
    return [str(paths)] if isinstance(paths, str | PurePath) else [str(path) for path in paths]


def _names(entries: list[dict[str, Any]]) -> list[str]:
    """Each source's name: its own, else its first path's, made unique by its index."""
    names = []
    for index, entry in enumerate(entries):
        if (name := entry.get("name")) is not None:
            if not NAME.fullmatch(str(name)):
                raise ConfigError(
                    f"data.mixture[{index}].name={name!r}: metric keys are made of it, so use "
                    f"letters, digits, '_', '.' and '-'"
                )
            if name in names:
                raise ConfigError(f"data.mixture: two sources are named {name!r}")
            names.append(str(name))
            continue
        name = path_name(entry["paths"][0])
        names.append(name if name not in names else f"{name}_{index}")
    return names


def path_name(path: str) -> str:
    """A short name for a path: a file's stem, a folder's or a glob's folder's name, a dataset's."""
    path = path.split("@")[0] if path.startswith("hf://") else path
    parts = PurePosixPath(path.rstrip("/")).parts
    while len(parts) > 1 and glob.has_magic(parts[-1]):
        parts = parts[:-1]
    stem = PurePosixPath(parts[-1]).stem if parts else "source"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", stem) or "source"


def rows_per_epoch(weights: Sequence[float], total: int) -> np.ndarray:
    """How many of an epoch's `total` rows each source gives: its share, rounded so they add up.

    Largest remainders round: no source is ever more than one row off its share.
    """
    exact = np.asarray(weights, dtype=np.float64) * total
    counts = np.floor(exact).astype(np.int64)
    behind = np.argsort(-(exact - counts), kind="stable")[: total - int(counts.sum())]
    counts[behind] += 1
    return counts


def endless_rows(size: int, count: int, epoch: int, seed: Sequence[int]) -> torch.Tensor:
    """Rows `epoch * count` to `(epoch + 1) * count` of one source's endless shuffled passes.

    Pass p over the source's `size` rows is a permutation drawn from `seed` and p.
    """
    first, pieces = epoch * count, []
    while count:
        number, position = divmod(first, size)
        take = min(count, size - position)
        pass_seed = np.random.SeedSequence([*seed, number]).generate_state(1, np.uint64)[0]
        generator = torch.Generator().manual_seed(int(pass_seed) % 2**63)
        pieces.append(torch.randperm(size, generator=generator)[position : position + take])
        first, count = first + take, count - take
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


class MixtureSampler(ResumableDistributedSampler):
    """The sampler of a mixture's training rows, drawn by weight (see the module docstring).

    The dataset holds the sources' rows one after another, `sizes` rows each; every epoch
    draws each source's `weights` share of them.
    """

    def __init__(self, dataset, sizes: Sequence[int], weights: Sequence[float], **options):
        super().__init__(dataset, **options)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.counts = rows_per_epoch(weights, int(self.sizes.sum()))

    def epoch_indices(self) -> torch.Tensor:
        starts = np.concatenate(([0], np.cumsum(self.sizes)[:-1]))
        drawn = [
            int(start) + endless_rows(int(size), int(count), self.epoch, [self.seed, source])
            for source, (start, size, count) in enumerate(
                zip(starts, self.sizes, self.counts, strict=True)
            )
        ]
        indices = torch.cat(drawn)
        if not self.shuffle:
            return indices
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return indices[torch.randperm(len(indices), generator=generator)]


def next_source(weights: np.ndarray, taken: Sequence[int]) -> int:
    """The source furthest behind its share of the rows taken so far, plus one."""
    return int(np.argmax(weights * (sum(taken) + 1) - np.asarray(taken)))


class MixedStream(IterableDataset):
    """The rows of several `StreamedRows`, interleaved by `weights` (see the module docstring).

    `run_rows`, when set, is its length, as for `StreamedRows`.
    """

    def __init__(self, streams: list[StreamedRows], weights: Sequence[float]):
        self.streams = streams
        self.weights = np.asarray(weights, dtype=np.float64)
        self.taken = [0] * len(streams)
        self.run_rows: int | None = None

    def __len__(self) -> int:
        if self.run_rows is None:
            raise TypeError("an endless stream has no length until the run's is set")
        return self.run_rows

    def __iter__(self) -> Iterator[list[Sample]]:
        rows = [iter(stream) for stream in self.streams]
        while True:
            source = next_source(self.weights, self.taken)
            row = next(rows[source])
            self.taken[source] += 1
            yield row

    def state_dict(self) -> dict[str, Any]:
        return {"taken": list(self.taken), "streams": [s.state_dict() for s in self.streams]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.taken = list(state_dict["taken"])
        for stream, state in zip(self.streams, state_dict["streams"], strict=True):
            stream.load_state_dict(state)


def check_same_mixture(state: dict[str, Any], sources: Sequence[WeightedSource]) -> None:
    """Refuse to resume a checkpoint of another data mixture (or of none, or one without).

    Where each source's rows stand only continues a run exactly on the same sources and
    weights.
    """
    saved = [(str(name), float(weight)) for name, weight in state.get("mixture", [])]
    mine = [(source.name, source.weight) for source in sources]
    if saved == mine:
        return

    def shown(mixture: list[tuple[str, float]]) -> str:
        sources = ", ".join(f"{name}: {weight:.4g}" for name, weight in mixture)
        return f"the data mixture {{{sources}}}" if mixture else "no data.mixture"

    raise ConfigError(
        f"This checkpoint trained on {shown(saved)}, and this run asks for {shown(mine)}: a "
        f"run resumes exactly only on the same sources and weights. Resume with the "
        f"checkpoint's data, or start a new run from its weights (scripts/export.py "
        f"ckpt_path=<checkpoint> format=merged, then model.pretrained=<that folder>)."
    )
