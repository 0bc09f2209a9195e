"""The stored token source: training, validation and test rows all from the token store."""

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from torchdata.stateful_dataloader import StatefulDataLoader

from src.data.corpus.rows import PackedRows
from src.data.corpus.token_store import TokenStore
from src.data.packing.packing import TokenAccounting
from src.data.text.sources.mixture import check_same_mixture
from src.data.text.sources.token_source import shuffled_documents
from src.utils.errors import DataError

if TYPE_CHECKING:  # the datamodule builds its source: imported for the types only
    from src.data.text.packed_text import PackedTextDataModule


class StoredSource:
    """The `TokenSource` of a corpus tokenised into a store.

    Its documents are split into train, val and test at random by `split_seed`, in the
    fractions `val_fraction` and `test_fraction`, and every split's rows are served by a
    resumable sampler (the training split's shuffled each epoch by `shuffle_seed` + epoch).
    """

    names: tuple[str, ...] = ()  # one source

    def __init__(self, module: "PackedTextDataModule"):
        self.module = module
        self.datasets: dict[str, PackedRows] = {}
        self.accounting: dict[str, TokenAccounting] = {}

    def store_parts(self) -> list[list[Path]]:
        return [self.module.source_files()]

    def split_documents(self, counts: Sequence[int]) -> dict[str, np.ndarray]:
        """A permutation of the documents by `split_seed`, cut by the fractions."""
        return split_by_fractions(sum(counts), self.module.fractions, self.module.split_seed)

    def setup(self, store: TokenStore) -> None:
        splits = self.split_documents(store.part_documents)
        self.datasets, self.accounting = self.module.store_splits(store, splits)

    def loader(self, split: str, batch_size: int, shuffle: bool) -> StatefulDataLoader:
        return self.module.split_loader(self.datasets[split], batch_size, shuffle)

    def packing_metrics(self) -> dict[str, float]:
        """The metrics of the training split as batched."""
        train = self.datasets["train"]
        return self.module.row_metrics(train.row_lengths(), len(train.pieces))

    def state_dict(self) -> dict[str, Any]:
        """Nothing: the loader's sampler resumes whatever the number of workers."""
        return {}

    def check_resume(self, state: dict[str, Any]) -> None:
        """Any stored run resumes, but one that trained on a data mixture."""
        check_same_mixture(state, [])


def split_by_fractions(
    count: int, fractions: dict[str, float], split_seed: int, where: str = ""
) -> dict[str, np.ndarray]:
    """`count` documents in train, val and test: a permutation by `split_seed`, cut by fractions.

    `where` says whose documents they are, in the error about too few.
    """
    val = max(1, round(count * fractions["val"]))
    test = round(count * fractions["test"])
    if count - val - test < 1:
        raise DataError(
            f"{count} documents{where} are too few for a train/val/test split with fractions "
            f"{fractions}; add text or change data.document_split"
        )
    order = shuffled_documents(count, split_seed)
    return {
        "train": np.sort(order[val + test :]),
        "val": np.sort(order[:val]),
        "test": np.sort(order[val : val + test]),
    }
