"""Packing tokenised samples into rows of `max_seq_len` tokens, without ever breaking one apart
unless asked to.

A sample is a `Sample`: its token ids and, per token, whether that token is a training target
(False on SFT prompts). Packing only decides which samples share a row; what the model sees of
a row (positions, boundaries, labels) is derived later, in `src.data.collate`.

Written here rather than taken from a library: the bin packers of the training stacks that
have them live inside their trainers' dataset pipelines, and none reports the token
accounting (kept, truncated, dropped) that the over-long policies need.
"""

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from src.utils.contracts import IGNORE_INDEX
from src.utils.errors import DataError

OVERLONG_POLICIES = ("truncate", "drop", "split", "raise")
PACKING_STRATEGIES = ("best_fit", "greedy")


@dataclass(frozen=True)
class Sample:
    """One document (pretraining) or one conversation (SFT) as token ids.

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
    lengths_before: list[int] = field(default_factory=list)
    lengths_after: list[int] = field(default_factory=list)

    def as_metrics(self, prefix: str) -> dict[str, int]:
        names = ("input", "kept", "truncated", "dropped")
        counts = {f"{prefix}/tokens_{name}": getattr(self, name) for name in names}
        counts[f"{prefix}/samples_truncated"] = self.samples_truncated
        counts[f"{prefix}/samples_dropped"] = self.samples_dropped
        counts[f"{prefix}/samples_split"] = self.samples_split
        return counts


def fit_to_length(
    samples: Sequence[Sample],
    max_len: int,
    policy: str,
    describe: Callable[[int], str] = "sample {}".format,
) -> tuple[list[Sample], TokenAccounting]:
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
    accounting = TokenAccounting()
    fitted = []
    for index, sample in enumerate(samples):
        length = len(sample)
        accounting.input += length
        accounting.lengths_before.append(length)
        if length == 0:
            continue
        if length <= max_len:
            pieces = [sample]
        elif policy == "raise":
            raise DataError(
                f"{describe(index)} has {length} tokens, more than max_seq_len={max_len}. Raise "
                f"data.max_seq_len, or choose data.overlong=truncate, drop or split"
            )
        elif policy == "drop":
            accounting.dropped += length
            accounting.samples_dropped += 1
            continue
        elif policy == "truncate":
            pieces = [Sample(sample.tokens[:max_len], sample.targets[:max_len])]
            accounting.truncated += length - max_len
            accounting.samples_truncated += 1
        else:
            pieces = [_piece(sample, start, max_len) for start in range(0, length, max_len)]
            accounting.samples_split += 1
        for piece in pieces:
            fitted.append(piece)
            accounting.kept += len(piece)
            accounting.lengths_after.append(len(piece))
    return fitted, accounting


def _piece(sample: Sample, start: int, max_len: int) -> Sample:
    """Tokens [start, start + max_len) of `sample`, remembering the target just after them."""
    end = start + max_len
    if end >= len(sample):
        next_token = sample.next_token
    else:
        next_token = int(sample.tokens[end]) if sample.targets[end] else IGNORE_INDEX
    offset = sample.position_offset + start
    return Sample(sample.tokens[start:end], sample.targets[start:end], offset, next_token)


def pack(lengths: Sequence[int], capacity: int, strategy: str = "best_fit") -> list[list[int]]:
    """Group sample indices into rows whose lengths sum to at most `capacity`.

    `best_fit`: best-fit decreasing, the longest sample first into the fullest row it still
    fits (fewest rows, least padding). `greedy`: in the given order, a new row whenever the
    next sample does not fit the current one (keeps neighbours together).
    Both are deterministic: equal inputs give equal rows.
    """
    if any(length > capacity or length < 1 for length in lengths):
        raise ValueError(f"every length must be in [1, {capacity}] before packing")
    if strategy == "best_fit":
        return _best_fit_decreasing(lengths, capacity)
    if strategy == "greedy":
        return _greedy(lengths, capacity)
    raise DataError(
        f"packing_strategy={strategy!r} is not a strategy; choose one of {PACKING_STRATEGIES}"
    )


def _best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Rows are kept sorted by free space, so the tightest row that fits is one bisection away."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    by_free_space: list[tuple[int, int]] = []  # (free tokens, row index), ascending
    for index in order:
        length = lengths[index]
        position = bisect.bisect_left(by_free_space, (length, -1))
        if position == len(by_free_space):
            rows.append([index])
            free, row = capacity - length, len(rows) - 1
        else:
            free, row = by_free_space.pop(position)
            rows[row].append(index)
            free -= length
        if free > 0:
            bisect.insort(by_free_space, (free, row))
    return rows


def _greedy(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    rows: list[list[int]] = []
    used = capacity
    for index, length in enumerate(lengths):
        if used + length > capacity:
            rows.append([])
            used = 0
        rows[-1].append(index)
        used += length
    return rows
