"""Preference pairs fitted to `max_seq_len`, read from the token store, and collated.

The store holds each pair as two documents, the prompt with the chosen response (document 2p)
and with the rejected one (2p + 1), whose targets are the response's tokens. `fit_pairs`
applies the over-long policy to both sequences of each pair; `PairRows` serves them, packed
(each row holds whole pairs) or one pair an item; `collate_pairs` makes a token batch of
them in which the pair's two sequences go through the model in one forward.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from src.data.corpus.token_store import TokenStore
from src.data.packing.collate import collate_rows
from src.data.packing.packing import (
    Pieces,
    Rows,
    Sample,
    TokenAccounting,
    _lengths_array,
    compact,
)
from src.utils.errors import DataError

SIDES = ("chosen", "rejected")
OVERLONG_POLICIES = ("truncate", "drop", "raise")


def prompt_lengths(store: TokenStore) -> np.ndarray:
    """The tokens before each document's first target: its prompt (the whole document if none)."""
    assert store.targets is not None  # preference stores keep a target mask
    targets = np.flatnonzero(store.targets)
    starts, ends = store.offsets[:-1], store.offsets[1:]
    first = np.searchsorted(targets, starts)
    found = first < len(targets)
    first_target = np.where(found, targets[np.minimum(first, len(targets) - 1)], ends)
    return np.minimum(first_target, ends) - starts


def fit_pairs(
    pairs: np.ndarray,
    lengths: np.ndarray,
    prompts: np.ndarray,
    max_len: int,
    policy: str,
    describe: Callable[[int], str],
) -> tuple[np.ndarray, Pieces, TokenAccounting]:
    """The `pairs` (store pair indices) that are kept, their two sequences' pieces, the accounting.

    `lengths` and `prompts` are every document's tokens and prompt tokens. A sequence longer
    than `max_len` keeps its whole response: `truncate` cuts its prompt from the left (at least
    one prompt token stays, which predicts the response's first), `drop` leaves the pair out,
    `raise` stops naming the row (`describe(pair)`). A response that does not fit with one
    prompt token stops the run naming its row, whatever the policy but `drop`.
    """
    if policy not in OVERLONG_POLICIES:
        raise DataError(
            f"data.overlong={policy!r}: preference pairs take one of {OVERLONG_POLICIES} "
            f"(truncate cuts prompts from the left; responses are never cut)"
        )
    documents = np.stack((2 * pairs, 2 * pairs + 1), 1).reshape(-1)  # chosen, rejected, ...
    length, prompt = lengths[documents], prompts[documents]
    cut = np.maximum(length - max_len, 0)
    over = cut > 0
    if policy == "raise" and over.any():
        index = int(np.flatnonzero(over)[0])
        raise DataError(
            f"{describe(int(pairs[index // 2]))}: its {SIDES[index % 2]} sequence has "
            f"{length[index]} tokens (a prompt of {prompt[index]}), more than "
            f"data.max_seq_len={max_len}. Raise data.max_seq_len, or choose "
            f"data.overlong=truncate (cuts prompts from the left) or drop"
        )
    if policy == "drop":
        keep = ~over.reshape(-1, 2).any(1)
    else:
        keep = np.ones(len(pairs), dtype=bool)
        unfit = np.flatnonzero(over & (cut >= prompt))
        if len(unfit):
            index = int(unfit[0])
            raise DataError(
                f"{describe(int(pairs[index // 2]))}: its {SIDES[index % 2]} response has "
                f"{length[index] - prompt[index]} tokens, too many for data.max_seq_len="
                f"{max_len} with even one prompt token before it. Raise data.max_seq_len, or "
                f"choose data.overlong=drop to leave such pairs out"
            )
    kept = np.repeat(keep, 2)
    accounting = TokenAccounting(
        input=int(length.sum()),
        kept=int((length - cut)[kept].sum()),
        truncated=int(cut[kept].sum()),
        dropped=int(length[~kept].sum()),
        samples_truncated=int((over & kept).sum()),
        samples_dropped=int((~kept).sum()),
        lengths_before=_lengths_array(length),
        lengths_after=_lengths_array((length - cut)[kept]),
    )
    pieces = Pieces(compact(documents[kept]), compact(cut[kept]), compact((length - cut)[kept]))
    return pairs[keep], pieces, accounting


@dataclass(frozen=True)
class PairSample:
    """One pair's two sequences, and their reference log-probabilities when precomputed."""

    chosen: Sample
    rejected: Sample
    reference: tuple[float, float] | None = None

    def __len__(self) -> int:
        return len(self.chosen) + len(self.rejected)


class PairRows(Dataset):
    """Item i is row i: the pairs that share it, or one pair when not packing.

    `pairs` are the store's pair indices of the kept pairs, `pieces` their sequences (chosen,
    rejected, chosen, ...), `rows` group pair numbers 0..len(pairs)-1. `reference` [store
    pairs, 2], once set, holds the pairs' precomputed reference log-probabilities.
    """

    def __init__(self, store: TokenStore, pairs: np.ndarray, pieces: Pieces, rows: Rows):
        self.store = store
        self.pairs = pairs
        self.pieces = pieces
        self.rows = rows
        self.reference: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> list[PairSample]:
        return [self.pair(int(number)) for number in self.rows[index]]

    def pair(self, number: int) -> PairSample:
        reference = None
        if self.reference is not None:
            chosen, rejected = self.reference[self.pairs[number]]
            reference = (float(chosen), float(rejected))
        return PairSample(self.sequence(2 * number), self.sequence(2 * number + 1), reference)

    def sequence(self, index: int) -> Sample:
        """Piece `index`: its document past any cut prompt tokens, from position 0."""
        begin = int(self.store.offsets[self.pieces.sample[index]]) + int(self.pieces.start[index])
        tokens, targets = self.store.read(begin, begin + int(self.pieces.length[index]))
        assert targets is not None  # preference stores keep a target mask
        return Sample(torch.from_numpy(tokens.astype(np.int64)), torch.from_numpy(targets != 0))

    def pair_lengths(self) -> np.ndarray:
        return self.pieces.length.reshape(-1, 2).sum(1)

    def row_lengths(self) -> np.ndarray:
        """The tokens of each row (both sequences of its pairs)."""
        return self.rows.lengths(self.pair_lengths())


def collate_pairs(
    items: Sequence[Sequence[PairSample]],
    pad_id: int,
    row_length: int | None,
    pad_to_multiple_of: int = 1,
) -> dict[str, torch.Tensor]:
    """A token batch (`collate_rows`'s) of the pairs of `items`, each sequence a document.

    Packed (`row_length` given), each item is a row holding its pairs' sequences back to back,
    chosen before rejected. Padded, each sequence gets a row of its own: the P chosen ones
    first, then the P rejected ones, as TRL's concatenated forward has them. Added:
    `pair_documents` [P, 2], the document index of each pair's chosen and rejected sequence,
    and `reference_logps` [P, 2] when the pairs carry them.
    """
    pairs = [pair for item in items for pair in item]
    count = len(pairs)
    if row_length is not None:
        rows = [[s for pair in item for s in (pair.chosen, pair.rejected)] for item in items]
        chosen = torch.arange(0, 2 * count, 2)
        rejected = chosen + 1
    else:
        rows = [[pair.chosen] for pair in pairs] + [[pair.rejected] for pair in pairs]
        chosen = torch.arange(count)
        rejected = chosen + count
    batch = collate_rows(rows, pad_id, row_length, pad_to_multiple_of)
    batch["pair_documents"] = torch.stack((chosen, rejected), 1)
    if pairs[0].reference is not None:
        batch["reference_logps"] = torch.tensor(
            [pair.reference for pair in pairs], dtype=torch.float32
        )
    return batch
