"""What the text datamodules share: split by document, tokenise (cached), fit the over-long
samples, pack or pad, and serve resumable batches whose metadata `collate_rows` derives.

Subclasses say where the samples come from: `load_documents()` returns the raw documents,
`tokenize(document)` turns one into a `Sample`, `document_text(document)` gives its text (to
train a BPE tokenizer on) and `source_fingerprint()` identifies the source for the cache.
"""

import logging
from abc import ABC, abstractmethod
from functools import partial
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from src.data.collate import collate_rows
from src.data.packing import Sample, TokenAccounting, fit_to_length, pack
from src.data.sampler import SplitLoaders, resumable_loader
from src.data.splits import check_fractions, check_loader_options
from src.data.token_cache import cache_key, cached_samples
from src.data.tokenizers import build_tokenizer, tokenizer_from_state, tokenizer_state
from src.utils.errors import CheckpointError, ConfigError, DataError

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")


class RowDataset(Dataset):
    """Item i is row i: the list of samples that share it (one sample when not packing)."""

    def __init__(self, samples: list[Sample], rows: list[list[int]]):
        self.samples = samples
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> list[Sample]:
        return [self.samples[i] for i in self.rows[index]]


class BucketedBatches(Dataset):
    """Item i is a whole batch: rows of similar lengths, so that padding them costs little.

    Batches are formed once: a permutation by `seed` is cut into windows of 50 batches, each
    window sorted by length and cut into batches (the last, partial one of the split is
    dropped when `drop_last`). The sampler then shuffles the order of the batches.
    """

    def __init__(self, rows: RowDataset, batch_size: int, seed: int, drop_last: bool):
        lengths = [sum(len(sample) for sample in rows[i]) for i in range(len(rows))]
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
        window = 50 * batch_size
        self.batches = []
        for start in range(0, len(order), window):
            by_length = sorted(order[start : start + window], key=lambda i: lengths[i])
            self.batches += [
                by_length[i : i + batch_size] for i in range(0, len(by_length), batch_size)
            ]
        if drop_last and self.batches and len(self.batches[-1]) < batch_size:
            self.batches.pop()
        self.rows = rows

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> list[list[Sample]]:
        return [self.rows[i] for i in self.batches[index]]


class PackedTextDataModule(SplitLoaders, LightningDataModule, ABC):
    """Token batches for `LanguageModel`, packed (`packing=true`) or padded, from the same samples.

    Packed: best-fit-decreasing (or order-preserving `greedy`) rows of exactly `max_seq_len`
    tokens, `batch_size` rows per batch. Padded: one sample per row, `batch_size` samples per
    batch, padded to the batch's longest (a multiple of `pad_to_multiple_of`), and with
    `bucket_by_length` drawn from samples of similar lengths (less padding). Either way each
    sample keeps its own positions, attention and loss (see `src.data.collate`). Samples longer
    than `max_seq_len` follow `overlong` (truncate, drop, split or raise).

    Documents are split into train/val/test at random by `split_seed`, so the split does not
    change with the training seed; rows are shuffled each epoch by `shuffle_seed` + epoch, and
    sharded evenly across DDP ranks.
    """

    default_overlong = "truncate"

    def __init__(
        self,
        max_seq_len: int = 256,
        packing: bool = True,
        packing_strategy: str = "best_fit",
        overlong: str | None = None,
        batch_size: int = 16,
        eval_batch_size: int | None = None,
        pad_to_multiple_of: int = 8,
        bucket_by_length: bool = False,
        tokenizer: dict[str, Any] | None = None,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        split_seed: int = 1234,
        shuffle_seed: int | None = None,
        num_workers: int = 0,
        cache_dir: str | None = None,
    ):
        super().__init__()
        if max_seq_len < 2:
            raise ConfigError(f"data.max_seq_len must be at least 2, got {max_seq_len}")
        check_loader_options(batch_size, eval_batch_size)
        check_fractions(val_fraction, test_fraction)
        self.max_seq_len = max_seq_len
        self.packing = packing
        self.packing_strategy = packing_strategy
        self.overlong = overlong or self.default_overlong
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.pad_to_multiple_of = pad_to_multiple_of
        if bucket_by_length and packing:
            raise ConfigError("data.bucket_by_length is for padded batches: set data.packing=false")
        self.bucket_by_length = bucket_by_length
        self.tokenizer_options = dict(tokenizer or {})
        self.fractions = {"val": val_fraction, "test": test_fraction}
        self.split_seed = split_seed
        self.shuffle_seed = shuffle_seed
        self.num_workers = num_workers
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.tokenizer = None
        self.datasets: dict[str, RowDataset] = {}
        # What prepare_data tokenised, handed to setup in the same process (then dropped).
        self._prepared: tuple[list[Any], dict[str, torch.Tensor], list[Sample]] | None = None
        self.accounting: dict[str, TokenAccounting] = {}

    # -- what subclasses provide -------------------------------------------------------------

    @abstractmethod
    def load_documents(self) -> list[Any]: ...

    @abstractmethod
    def tokenize(self, document: Any) -> Sample: ...

    @abstractmethod
    def document_text(self, document: Any) -> str: ...

    @abstractmethod
    def source_fingerprint(self) -> str: ...

    def describe(self, document: Any) -> str:
        """How errors name a document: its first words."""
        text = " ".join(self.document_text(document).split())
        return f"The document {text[:50]!r}{'...' if len(text) > 50 else ''}"

    # -- setup -------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        if self.tokenizer is None:
            self.setup()
        return self.tokenizer.vocab_size

    def prepare_data(self) -> None:
        """Tokenise into the cache once, on one process per node, before every rank's setup
        reads it back (with a cache folder; without one each rank tokenises for itself).
        This process's own setup then reuses the result instead of reading the files again."""
        if self.cache_dir is not None:
            self._prepared = self.tokenized()

    def tokenized(self) -> tuple[list[Any], dict[str, torch.Tensor], list[Sample]]:
        """(documents, document indices of each split, one sample per document), after setting
        `self.tokenizer` (trained or loaded) unless a checkpoint's state set it."""
        documents = self.load_documents()
        split_of = self.split_documents(len(documents))
        source = self.source_fingerprint()
        if self.tokenizer is None:
            self.tokenizer = build_tokenizer(
                **self.tokenizer_options,
                training_texts=lambda: (
                    self.document_text(documents[i]) for i in split_of["train"].tolist()
                ),
                cache_dir=self.cache_dir,
                cache_key=f"{source}|{self.split_seed}|{self.fractions}",
            )
        samples = cached_samples(
            self.cache_dir,
            cache_key(source, self.tokenizer.fingerprint),
            lambda: [self.tokenize(document) for document in documents],
        )
        return documents, split_of, samples

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        documents, split_of, samples = self._prepared or self.tokenized()
        self._prepared = None
        for split in SPLITS:
            indices = split_of[split].tolist()
            fitted, self.accounting[split] = fit_to_length(
                [samples[i] for i in indices],
                self.max_seq_len,
                self.overlong,
                describe=lambda i, indices=indices: self.describe(documents[indices[i]]),
            )
            if split != "test" and not fitted:
                raise DataError(
                    f"The {split} split has no samples left ({len(indices)} before applying "
                    f"overlong={self.overlong!r}); add documents or raise data.val_fraction"
                )
            self.datasets[split] = RowDataset(fitted, self.rows_of(fitted))
        self._log_summary()

    def split_documents(self, count: int) -> dict[str, torch.Tensor]:
        """Document indices of each split: a permutation by `split_seed`, cut by the fractions."""
        order = torch.randperm(count, generator=torch.Generator().manual_seed(self.split_seed))
        val = max(1, round(count * self.fractions["val"]))
        test = round(count * self.fractions["test"])
        if count - val - test < 1:
            raise DataError(
                f"{count} documents are too few for a train/val/test split with fractions "
                f"{self.fractions}; add text or change data.document_split"
            )
        return {
            "val": order[:val].sort().values,
            "test": order[val : val + test].sort().values,
            "train": order[val + test :].sort().values,
        }

    def rows_of(self, samples: list[Sample]) -> list[list[int]]:
        if not self.packing:
            return [[i] for i in range(len(samples))]
        return pack([len(s) for s in samples], self.max_seq_len, self.packing_strategy)

    def packing_metrics(self) -> dict[str, float]:
        """Rows, padding fraction and documents per row of the training split as batched: packed
        rows are `max_seq_len` slots; padded rows as long as their batch's longest."""
        dataset = self.datasets["train"]
        lengths = [sum(len(s) for s in dataset[i]) for i in range(len(dataset))]
        if self.packing:
            slots = len(lengths) * self.max_seq_len
        else:  # padded in consecutive batches of this many rows (the shuffle changes little)
            size = self.batch_size
            batches = (lengths[i : i + size] for i in range(0, len(lengths), size))
            slots = sum(len(batch) * max(batch) for batch in batches)
        return {
            "data/rows": len(lengths),
            "data/padding_fraction": 1 - sum(lengths) / max(1, slots),
            "data/documents_per_row": len(dataset.samples) / max(1, len(lengths)),
        }

    def _log_summary(self) -> None:
        for split, dataset in self.datasets.items():
            accounting = self.accounting[split]
            log.info(
                "%s: %d samples in %d rows (%d tokens kept, %d truncated, %d dropped)",
                split,
                len(dataset.samples),
                len(dataset),
                accounting.kept,
                accounting.truncated,
                accounting.dropped,
            )

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What checkpoints keep of the datamodule: its tokenizer, as plain strings."""
        return {} if self.tokenizer is None else {"tokenizer": tokenizer_state(self.tokenizer)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Use the checkpoint's tokenizer. Lightning calls this after `setup` when it resumes: a
        tokenizer that differs from the one setup built (a BPE retrained, a changed folder)
        replaces it, and the documents are tokenised again with it."""
        if "tokenizer" not in state_dict:
            if self.tokenizer is None:
                self.tokenizer = self._tokenizer_of_older_checkpoint()
            return
        stored = tokenizer_from_state(state_dict["tokenizer"])
        if self.tokenizer is not None and self.tokenizer.fingerprint == stored.fingerprint:
            return
        self.tokenizer = stored
        if self.datasets:
            log.warning("The checkpoint's tokenizer differs from this run's: tokenising again")
            self.datasets = {}
            self.setup()

    def _tokenizer_of_older_checkpoint(self):
        """The tokenizer of a checkpoint from before tokenizers were kept in checkpoints, when
        the config alone rebuilds it (bytes, or a pretrained folder)."""
        if self.tokenizer_options.get("kind", "auto") == "bpe":
            raise CheckpointError(
                "The checkpoint predates tokenizers in checkpoints, and its BPE tokenizer was "
                "trained during the run. Pass the run's tokenizer/ folder: --tokenizer <run "
                "dir>/tokenizer to scripts/generate.py, or the overrides "
                "data.tokenizer.kind=pretrained data.tokenizer.path=<run dir>/tokenizer."
            )
        return build_tokenizer(**self.tokenizer_options)

    # -- loaders -----------------------------------------------------------------------------

    def _loader(self, split: str, batch_size: int, shuffle: bool) -> StatefulDataLoader:
        dataset = self.datasets[split]
        if self.bucket_by_length:  # items are whole batches
            dataset = BucketedBatches(dataset, batch_size, self.split_seed, drop_last=shuffle)
            batch_size = None
        collate = partial(
            collate_rows,
            pad_id=self.tokenizer.pad_token_id,
            row_length=self.max_seq_len if self.packing else None,
            pad_to_multiple_of=self.pad_to_multiple_of,
        )
        return resumable_loader(self, dataset, batch_size, shuffle, collate_fn=collate)
