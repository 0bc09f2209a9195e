"""Packing tokenised samples into rows of `max_seq_len` tokens, on arrays of their lengths.

No sample is ever broken apart unless asked to, and nothing here touches a token.

`fit_to_length` applies the over-long policy and returns the `Pieces` that will be trained on
(document, start, length); `pack` groups them into `Rows` (index arrays). What the model sees
of a row (positions, boundaries, labels) is derived later, from the `Sample`s a dataset reads
for it, in `src.data.packing.collate`.

Written here rather than taken from a library: the bin packers of the training stacks that
have them live inside their trainers' dataset pipelines, and none reports the token
accounting (kept, truncated, dropped) that the over-long policies need.
"""

import array
import bisect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from src.utils.contracts import IGNORE_INDEX
from src.utils.errors import DataError

OVERLONG_POLICIES = ("truncate", "drop", "split", "raise")
PACKING_STRATEGIES = ("best_fit", "greedy")


@dataclass(frozen=True)
class Sample:
    """One document (pretraining) or one conversation (SFT), or a piece of one, as token ids.

    `targets[i]` says whether token i may be a training target, i.e. whether the model is taught
    to predict it from the tokens before it. `position_offset` is where the sample's positions
    start: 0, except for the continuation of a sample split by the `split` policy, whose
    `next_token` is the target of its last token: the first token of the next piece
    (IGNORE_INDEX when there is none or it is not a target).
    """

    tokens: torch.Tensor  # [n] int64
    targets: torch.Tensor  # [n] bool
    position_offset: int = 0
    next_token: int = IGNORE_INDEX

    def __len__(self) -> int:
        return len(self.tokens)


def index_dtype(largest: int) -> np.dtype:
    """int32 for non-negative integers up to `largest` when it fits, else int64.

    The index arrays of a corpus of millions of documents then take half the memory.
    """
    return np.dtype(np.int32 if largest < 2**31 else np.int64)


def compact(values: np.ndarray) -> np.ndarray:
    """Non-negative integers in `index_dtype`."""
    values = np.asarray(values)
    return values.astype(index_dtype(int(values.max()) if len(values) else 0), copy=False)


def _lengths_array(values=()) -> array.array:
    """A compact sequence of lengths (4 bytes a sample), plain to whoever plots it."""
    values = compact(np.asarray(values, dtype=np.int64))
    return array.array("i" if values.dtype == np.int32 else "q", values.tobytes())


@dataclass
class TokenAccounting:
    """Where the tokens of the raw samples went; `input == kept + truncated + dropped`."""

    input: int = 0
    kept: int = 0
    truncated: int = 0
    dropped: int = 0
    samples_truncated: int = 0
    samples_dropped: int = 0
    samples_split: int = 0
    lengths_before: array.array = field(default_factory=_lengths_array)
    lengths_after: array.array = field(default_factory=_lengths_array)

    @classmethod
    def total(cls, parts: Sequence["TokenAccounting"]) -> "TokenAccounting":
        """The accounting of several sources' samples together."""
        counts = [
            *("input", "kept", "truncated", "dropped"),
            *("samples_truncated", "samples_dropped", "samples_split"),
        ]
        total = cls(**{name: sum(getattr(part, name) for part in parts) for name in counts})
        for when in ("lengths_before", "lengths_after"):
            lengths = np.concatenate([np.asarray(getattr(part, when)) for part in parts])
            setattr(total, when, _lengths_array(lengths))
        return total

    def as_metrics(self, prefix: str) -> dict[str, int]:
        names = ("input", "kept", "truncated", "dropped")
        counts = {f"{prefix}/tokens_{name}": getattr(self, name) for name in names}
        counts[f"{prefix}/samples_truncated"] = self.samples_truncated
        counts[f"{prefix}/samples_dropped"] = self.samples_dropped
        counts[f"{prefix}/samples_split"] = self.samples_split
        return counts


@dataclass(frozen=True)
class Pieces:
    """What is trained on: piece i is tokens [start[i], start[i] + length[i]) of `sample[i]`.

    `continued`: pieces of one sample continue each other (the `split` policy), so each but the
    last has the next piece's first token as its last target.
    """

    sample: np.ndarray  # int32 or int64 (see `compact`)
    start: np.ndarray
    length: np.ndarray
    continued: bool = False

    def __len__(self) -> int:
        return len(self.sample)


def describe_text(text: str) -> str:
    """How errors name a document: its first words."""
    words = " ".join(text.split())
    return f"The document {words[:50]!r}{'...' if len(words) > 50 else ''}"


def fit_to_length(
    lengths: np.ndarray,
    max_len: int,
    policy: str,
    describe: Callable[[int], str] = "sample {}".format,
) -> tuple[Pieces, TokenAccounting]:
    """Apply the over-long policy to every sample longer than `max_len` tokens.

    - `truncate`: keep the first `max_len` tokens;
    - `drop`: leave the sample out;
    - `split`: cut it into pieces of at most `max_len` tokens; each continuation keeps its
      positions (it starts at position `max_len`, `2 * max_len`, ...) but cannot see the
      pieces before it;
    - `raise`: stop with an error naming the sample (`describe(index)`).
    Empty samples are always dropped.
    """
    if policy not in OVERLONG_POLICIES:
        raise DataError(f"overlong={policy!r} is not a policy; choose one of {OVERLONG_POLICIES}")
    lengths = np.asarray(lengths, dtype=np.int64)
    over = lengths > max_len
    if policy == "raise" and over.any():
        index = int(np.flatnonzero(over)[0])
        raise DataError(
            f"{describe(index)} has {lengths[index]} tokens, more than max_seq_len={max_len}. "
            f"Raise data.max_seq_len, or choose data.overlong=truncate, drop or split"
        )
    accounting = TokenAccounting(input=int(lengths.sum()), lengths_before=_lengths_array(lengths))
    keep = (lengths > 0) & ~over if policy == "drop" else lengths > 0
    samples = np.flatnonzero(keep)
    if policy == "split":
        pieces = _split(lengths[samples], compact(samples), max_len)
        accounting.samples_split = int(over.sum())
    else:
        samples = compact(samples)
        length = compact(np.minimum(lengths[samples], max_len))
        pieces = Pieces(samples, np.zeros_like(samples), length)
        if policy == "drop":
            accounting.dropped = int(lengths[over].sum())
            accounting.samples_dropped = int(over.sum())
        else:
            accounting.truncated = int((lengths[over] - max_len).sum())
            accounting.samples_truncated = int(over.sum())
    accounting.kept = int(pieces.length.sum())
    accounting.lengths_after = _lengths_array(pieces.length)
    return pieces, accounting


def no_samples_left(split: str, lengths: np.ndarray, max_seq_len: int, answers: bool) -> str:
    """Why a split holds no sample, and what to change.

    Its share of the documents, or the length that the over-long policy dropped them all for
    (`answers`: prompt-answer pairs, whose ends truncation would cut).
    """
    if not lengths.any():
        share = (
            "raise data.val_fraction"
            if split == "val"
            else "lower data.val_fraction and data.test_fraction"
        )
        return (
            f"The {split} split has no samples: it got {len(lengths)} documents with text. Add "
            f"documents, or {share}."
        )
    shortest = int(lengths[lengths > 0].min())
    instead = (
        "or shorten the prompts (data.overlong=truncate would cut the answers off)"
        if answers
        else "or choose data.overlong=truncate or split"
    )
    return (
        f"The {split} split has no samples left: all {int((lengths > 0).sum())} of its documents "
        f"are longer than data.max_seq_len={max_seq_len} tokens (the shortest has {shortest}, "
        f"the longest {int(lengths.max())}), and data.overlong=drop leaves them out. Raise "
        f"data.max_seq_len to at least {shortest}, {instead}."
    )


def _split(lengths: np.ndarray, samples: np.ndarray, max_len: int) -> Pieces:
    """The pieces of at most `max_len` tokens that cut each of `samples` (`lengths` long).

    They are computed in place in compact dtypes: a corpus has millions of pieces.
    """
    counts = -(-lengths // max_len)
    ends = np.cumsum(counts)  # one past each sample's last piece
    first = np.repeat(compact(ends - counts), counts)
    start = np.arange(len(first), dtype=first.dtype)
    start -= first  # the piece's number within its sample
    del first
    start = start.astype(index_dtype(int(lengths.max(initial=0))), copy=False)
    start *= max_len
    length = np.full(len(start), max_len, dtype=np.int32)
    length[ends - 1] = lengths - (counts - 1) * max_len  # each sample's last piece
    return Pieces(np.repeat(samples, counts), start, length, continued=True)


@dataclass(frozen=True)
class Rows:
    """Row i holds the items `order[offsets[i]:offsets[i + 1]]`, in that order."""

    order: np.ndarray  # int32 or int64 (see `compact`)
    offsets: np.ndarray  # one more than there are rows

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        index %= len(self)
        return self.order[self.offsets[index] : self.offsets[index + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(len(self)))

    def lengths(self, item_lengths: np.ndarray) -> np.ndarray:
        """The tokens in each row, given each item's length."""
        summed = np.concatenate(([0], np.cumsum(item_lengths[self.order])))
        return summed[self.offsets[1:]] - summed[self.offsets[:-1]]

    @classmethod
    def one_per_row(cls, count: int) -> "Rows":
        return cls(compact(np.arange(count)), compact(np.arange(count + 1)))


def pack(lengths: np.ndarray | Sequence[int], capacity: int, strategy: str = "best_fit") -> Rows:
    """Group item indices into rows whose lengths sum to at most `capacity`.

    `best_fit`: best-fit decreasing, the longest item first into the fullest row it still
    fits (fewest rows, least padding). `greedy`: in the given order, a new row whenever the
    next item does not fit the current one (keeps neighbours together).
    Both are deterministic: equal inputs give equal rows. Ties go to the earlier item and to
    the row opened first.
    """
    lengths = np.asarray(lengths)
    if len(lengths) and (lengths.max() > capacity or lengths.min() < 1):
        raise ValueError(f"every length must be in [1, {capacity}] before packing")
    lengths = lengths.astype(index_dtype(capacity), copy=False)
    if strategy not in PACKING_STRATEGIES:
        raise DataError(
            f"packing_strategy={strategy!r} is not a strategy; choose one of {PACKING_STRATEGIES}"
        )
    if not len(lengths):
        return Rows(compact(np.zeros(0, np.int64)), compact(np.zeros(1, np.int64)))
    if strategy == "best_fit":
        return _best_fit_decreasing(lengths, capacity)
    return _greedy(lengths, capacity)


class _OpenRows:
    """Rows with free space, in buckets by free tokens.

    Each bucket is kept as chunks of row ids and sorted only when rows are taken from it (the
    earliest rows first).
    """

    def __init__(self):
        self.buckets: dict[int, list[np.ndarray]] = {}
        self.free_sizes: list[int] = []  # the keys of `buckets`, ascending

    def add(self, free: int, rows: np.ndarray) -> None:
        if free == 0 or not len(rows):
            return
        if free not in self.buckets:
            bisect.insort(self.free_sizes, free)
            self.buckets[free] = []
        self.buckets[free].append(rows)

    def tightest(self, length: int) -> int | None:
        """The least free space of any row that `length` tokens fit, if any does."""
        position = bisect.bisect_left(self.free_sizes, length)
        return self.free_sizes[position] if position < len(self.free_sizes) else None

    def take(self, free: int, count: int) -> np.ndarray:
        """The first `count` rows (or fewer, all there are) with exactly `free` tokens free."""
        chunks = self.buckets[free]
        rows = chunks[0] if len(chunks) == 1 else np.sort(np.concatenate(chunks))
        taken, rest = rows[:count], rows[count:]
        if len(rest):
            self.buckets[free] = [rest]
        else:
            del self.buckets[free]
            self.free_sizes.remove(free)
        return taken


def _best_fit_decreasing(lengths: np.ndarray, capacity: int) -> Rows:
    """Best-fit decreasing, with the items of one length placed together.

    The tightest rows that fit take them in row order, each as many as it holds, and what is
    left opens new rows. This places every item where the one-at-a-time algorithm would, in
    O(n log n) and a loop over distinct lengths and free sizes rather than over items.
    """
    order = compact(np.argsort(-lengths, kind="stable"))  # longest first, ties by index
    row_of = np.empty(len(order), dtype=order.dtype)  # of the items in `order`; rows <= items
    open_rows, row_count = _OpenRows(), 0
    sorted_lengths = lengths[order]
    group_starts = np.flatnonzero(np.diff(sorted_lengths, prepend=-1))
    for start, end in zip(group_starts, [*group_starts[1:], len(order)], strict=True):
        length, cursor = int(sorted_lengths[start]), int(start)
        while cursor < end:
            remaining = end - cursor
            free = open_rows.tightest(length)
            if free is None:  # new rows, each filled with as many items as it holds
                free, per_row = capacity, capacity // length
                rows = np.arange(row_count, row_count + -(-remaining // per_row))
                row_count += len(rows)
            else:
                per_row = free // length
                rows = open_rows.take(free, -(-remaining // per_row))
            placed = min(remaining, len(rows) * per_row)
            row_of[cursor : cursor + placed] = np.repeat(rows, per_row)[:placed]
            cursor += placed
            last = placed - (len(rows) - 1) * per_row  # items in the last row taken
            open_rows.add(free - per_row * length, rows[:-1])
            open_rows.add(free - last * length, rows[-1:])
    del sorted_lengths
    by_row = np.argsort(row_of, kind="stable")  # rows keep their items in placement order
    offsets = np.concatenate(([0], np.cumsum(np.bincount(row_of, minlength=row_count))))
    return Rows(compact(order[by_row]), compact(offsets))


def _greedy(lengths: np.ndarray, capacity: int) -> Rows:
    """Greedy rows, found with one search for every item i, then a walk from row start to row start.

    A row starting at item i ends before the first item whose end passes i's start plus
    `capacity`.
    """
    ends = np.cumsum(lengths)
    next_start = np.searchsorted(ends, ends - lengths + capacity, side="right")
    starts, index = array.array("q", [0]), 0
    while index < len(lengths):
        index = int(next_start[index])
        starts.append(index)
    return Rows(compact(np.arange(len(lengths))), compact(np.frombuffer(starts, dtype=np.int64)))
