"""The contract between a text datamodule and the source of its token rows.

`data.streaming` picks the source: `StoredSource` (`src.data.text.sources.stored`) serves every
split from the token store of the corpus; `StreamedSource` (`src.data.text.sources.streamed`)
streams the training rows and serves validation and test from the store of held-out files.
The datamodule builds the store, owns the tokenizer (all its checkpoints keep) and collates;
the source says what the store holds, how its documents split, and what each loader reads.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from src.data.corpus.rows import PackedRows
from src.data.corpus.token_store import TokenStore
from src.data.packing.packing import TokenAccounting, compact


class TokenSource(Protocol):
    """Where a text datamodule's rows come from: its token store's splits and its training rows.

    The training rows are one of those splits, or a stream.
    """

    datasets: dict[str, PackedRows]  # the rows of each split the store serves, once set up
    accounting: dict[str, TokenAccounting]  # what the over-long policy did, per split
    # A data mixture's sources, which validation and test serve a loader each; else empty.
    names: tuple[str, ...]

    def store_parts(self) -> list[list[Path]]:
        """The files the token store is built from, in parts (a mixture's sources; else one)."""
        ...

    def split_documents(self, counts: Sequence[int]) -> dict[str, np.ndarray]:
        """The store's document indices of each split it serves, given each part's count."""
        ...

    def setup(self, store: TokenStore) -> None:
        """Fill `datasets` and `accounting` (the training split's included) from `store`."""
        ...

    def loader(
        self, split: str, batch_size: int, shuffle: bool
    ) -> StatefulDataLoader | list[StatefulDataLoader]:
        """The resumable loader of `split`: its position goes into checkpoints.

        A mixture's validation and test have one per source, in the order of `names`.
        """
        ...

    def packing_metrics(self) -> dict[str, float]:
        """Rows, padding fraction and documents per row of the training rows."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run must match to continue the training rows exactly."""
        ...

    def check_resume(self, state: dict[str, Any]) -> None:
        """Refuse, before training, to resume from a checkpoint whose `state_dict` differs."""
        ...


def shuffled_documents(count: int, split_seed: int) -> np.ndarray:
    """The document indices 0..count-1 in the order `split_seed` draws, to cut into splits.

    The order is the same whatever the training seed, so that runs compare on the same
    held-out documents.
    """
    order = torch.randperm(count, generator=torch.Generator().manual_seed(split_seed))
    return compact(order.numpy())
