"""Datasets over a token store: rows, and batches of rows, read from memory-mapped tokens.

Rows are read on demand, as the `Sample`s that `collate_rows` turns into a batch.
"""

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
from torch.utils.data import Dataset

from src.data.packing.packing import Pieces, Rows, Sample, compact
from src.utils.contracts import IGNORE_INDEX


class ReadsTokens(Protocol):
    """Documents back to back: a `TokenStore`, or one streamed buffer's tokens."""

    offsets: np.ndarray  # document i is tokens [offsets[i], offsets[i + 1])

    def read(self, begin: int, end: int) -> tuple[np.ndarray, np.ndarray | None]: ...


class PackedRows(Dataset):
    """Item i is row i: the samples that share it (one sample when not packing).

    `pieces.sample` are document indices of `store`.
    """

    def __init__(self, store: ReadsTokens, pieces: Pieces, rows: Rows):
        self.store = store
        self.pieces = pieces
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> list[Sample]:
        return [self.piece(int(i)) for i in self.rows[index]]

    def piece(self, index: int) -> Sample:
        """Piece `index` read from the store, with the target after its end when it continues."""
        store, pieces = self.store, self.pieces
        document = int(pieces.sample[index])
        start = int(pieces.start[index])
        begin = int(store.offsets[document]) + start
        end = begin + int(pieces.length[index])
        continues = pieces.continued and end < store.offsets[document + 1]
        # A continued piece reads one token more: the next piece's first, its last target.
        ids, mask = store.read(begin, end + int(continues))
        tokens = torch.from_numpy(ids.astype(np.int64))
        if mask is None:
            targets = torch.ones(len(tokens), dtype=torch.bool)
        else:
            targets = torch.from_numpy(mask != 0)
        next_token = IGNORE_INDEX
        if continues:
            if targets[-1]:
                next_token = int(tokens[-1])
            tokens, targets = tokens[:-1], targets[:-1]
        return Sample(tokens, targets, start, next_token)

    @property
    def samples(self) -> "PieceList":
        """Every piece of every row, in piece order, read on demand."""
        return PieceList(self)

    def row_lengths(self) -> np.ndarray:
        return self.rows.lengths(self.pieces.length)


def concatenated(parts: Sequence[PackedRows]) -> PackedRows:
    """The rows of `parts`, which read one store, one part after another.

    Row i of part k is row i + the rows of the parts before it.
    """
    store = parts[0].store
    pieces = [part.pieces for part in parts]
    piece_starts = np.cumsum([0] + [len(p) for p in pieces[:-1]])
    order_starts = np.cumsum([0] + [len(part.rows.order) for part in parts[:-1]])
    order = [
        part.rows.order.astype(np.int64) + start
        for part, start in zip(parts, piece_starts, strict=True)
    ]
    offsets = [
        part.rows.offsets[1:].astype(np.int64) + start
        for part, start in zip(parts, order_starts, strict=True)
    ]
    return PackedRows(
        store,
        Pieces(
            compact(np.concatenate([p.sample for p in pieces])),
            compact(np.concatenate([p.start for p in pieces])),
            compact(np.concatenate([p.length for p in pieces])),
            continued=pieces[0].continued,
        ),
        Rows(compact(np.concatenate(order)), compact(np.concatenate([[0], *offsets]))),
    )


class PieceList(Sequence[Sample]):
    """The pieces of a `PackedRows` as a sequence of `Sample`s, none held in memory."""

    def __init__(self, rows: PackedRows):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows.pieces)

    def __getitem__(self, index: int) -> Sample:  # type: ignore[override]  # ints only, no slices
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        return self.rows.piece(index % len(self))


class BucketedBatches(Dataset):
    """Item i is a whole batch: rows of similar lengths, so that padding them costs little.

    Batches are formed once: a permutation by `seed` is cut into windows of 50 batches, each
    window sorted by length and cut into batches (the last, partial one of the split is
    dropped when `drop_last`). The sampler then shuffles the order of the batches.
    """

    def __init__(self, rows: PackedRows, batch_size: int, seed: int, drop_last: bool):
        lengths = rows.row_lengths()
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).numpy()
        window = 50 * batch_size
        batches = []
        for start in range(0, len(order), window):
            chunk = order[start : start + window]
            by_length = chunk[np.argsort(lengths[chunk], kind="stable")]
            batches += np.split(by_length, range(batch_size, len(by_length), batch_size))
        if drop_last and batches and len(batches[-1]) < batch_size:
            batches.pop()
        self.batches: Sequence[np.ndarray] = batches
        self.rows = rows

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> list[list[Sample]]:
        return [self.rows[int(i)] for i in self.batches[index]]
