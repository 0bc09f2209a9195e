"""What the text datamodules share, from reading the corpus to serving resumable batches.

They read the corpus through `datasets`, tokenise it once into a memory-mapped token store, fit
the over-long samples of each split, pack or pad, and serve resumable batches whose metadata
`collate_rows` derives. Which files the store holds, how its documents split and where the
training rows come from is the datamodule's `source` (`src.data.text.sources.token_source`).

Subclasses say where the documents come from and how they become tokens: `source_files()`,
`source_options()` (what else decides the tokens: how files are cut, the chat template),
`read_corpus(files, work_dir)` (a `datasets.Dataset`, read only when the store is built or a
BPE tokenizer trained), `training_texts(corpus, rows, part)` (the texts of those rows, to train a
BPE tokenizer on) and `encoder(part)` (the batched function `Dataset.map` runs: an Arrow table
of rows in, `input_ids` and, with `has_targets`, `targets` list columns out; `part` is the
store's part it encodes, a data mixture's source, for its errors to name).
"""

import hashlib
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import cache, partial
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import torch
from lightning.pytorch import LightningDataModule
from torchdata.stateful_dataloader import StatefulDataLoader

from src.data.corpus.encoding import flat_column
from src.data.corpus.hub import HubOptions
from src.data.corpus.readers import (
    content_fingerprint,
    resolve_files,
    separately_mapped_parts,
)
from src.data.corpus.rows import BucketedBatches, PackedRows
from src.data.corpus.token_store import StoreWriter, TokenStore, builder_name, load_or_build
from src.data.corpus.tokenizers import (
    ByteTokenizer,
    FileTokenizer,
    build_tokenizer,
    tokenizer_from_state,
    tokenizer_state,
)
from src.data.packing.collate import collate_rows
from src.data.packing.packing import (
    Rows,
    TokenAccounting,
    describe_text,
    fit_to_length,
    no_samples_left,
    pack,
)
from src.data.sampler import SplitLoaders, check_one_batch, resumable_loader
from src.data.splits import check_fractions, check_loader_options
from src.data.text.sources.stored import StoredSource
from src.data.text.sources.token_source import TokenSource
from src.utils.contracts import TOKENS
from src.utils.errors import CheckpointError, ConfigError, DataError

log = logging.getLogger(__name__)

STORE_FORMAT = "store-v1"
# Below this many rows a worker, forked and fed, costs more than it saves.
ROWS_PER_WORKER = 20_000


class PackedTextDataModule(SplitLoaders, LightningDataModule, ABC):
    """Token batches for `LanguageModel`, packed (`packing=true`) or padded, from the same samples.

    Packed: best-fit-decreasing (or order-preserving `greedy`) rows of exactly `max_seq_len`
    tokens, `batch_size` rows per batch. Padded: one sample per row, `batch_size` samples per
    batch, padded to the batch's longest (a multiple of `pad_to_multiple_of`), and with
    `bucket_by_length` drawn from samples of similar lengths (less padding). Either way each
    sample keeps its own positions, attention and loss (see `src.data.packing.collate`). Samples
    longer than `max_seq_len` follow `overlong` (truncate, drop, split or raise).

    Documents are split into train/val/test at random by `split_seed`, so the split does not
    change with the training seed; rows are shuffled each epoch by `shuffle_seed` + epoch, and
    sharded evenly across DDP ranks (`StoredSource`; a subclass may serve another `source`).

    The token store lives in `cache_dir` (a temporary folder when null). `prepare_data` builds
    it once per node (`prepare_per_node=true`, for a `cache_dir` on each node's own disk), or
    once per job when `prepare_per_node=false` (a `cache_dir` every node shares); every rank's
    `setup` then maps the same store. `num_proc` processes tokenise (null: one per CPU core).

    A path `hf://datasets/<org>/<name>` is that Hugging Face dataset's split `hf_split` (its
    config `hf_config`, revision `hf_revision`), written once as a Parquet file into `cache_dir`
    (`src.data.corpus.hub`); its validation and test documents come from the fractions, as a
    local file's do.
    """

    batch_kind = TOKENS
    default_overlong = "truncate"
    has_targets = False  # whether the store keeps a target mask (SFT)

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
        num_proc: int | None = None,
        prepare_per_node: bool = True,
        cache_dir: str | None = None,
        hf_split: str = "train",
        hf_config: str | None = None,
        hf_revision: str | None = None,
    ):
        super().__init__()
        if max_seq_len < 2:
            raise ConfigError(f"data.max_seq_len must be at least 2, got {max_seq_len}")
        if num_proc is not None and num_proc < 1:
            raise ConfigError(f"data.num_proc must be a positive integer or null, got {num_proc}")
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
        self.num_proc = num_proc or os.cpu_count() or 1
        self.prepare_data_per_node = prepare_per_node
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.hub = HubOptions(hf_split, hf_config, hf_revision, self.cache_dir)
        self._scratch: TemporaryDirectory | None = None  # the store's folder without cache_dir
        self.tokenizer: ByteTokenizer | FileTokenizer | None = None  # from store() or a checkpoint
        self.token_store: TokenStore | None = None
        self.source: TokenSource = StoredSource(self)

    # -- what subclasses provide -------------------------------------------------------------

    @abstractmethod
    def source_files(self) -> list[Path]: ...

    @abstractmethod
    def source_options(self) -> str: ...

    @abstractmethod
    def read_corpus(self, files: list[Path], work_dir: Path) -> datasets.Dataset: ...

    @abstractmethod
    def training_texts(
        self, corpus: datasets.Dataset, rows: np.ndarray, part: int = 0
    ) -> Iterator[str]: ...

    @abstractmethod
    def encoder(self, part: int = 0) -> Callable[[pa.Table, list[int]], pa.Table]: ...

    def tokenising_is_cheap(self) -> bool:
        """Whether tokenising runs at memory speed, so that worker processes would only add copies.

        Then one process tokenises, whatever `num_proc` says.
        """
        return False

    def describe(self, document: int) -> str:
        """How errors name a document of the store: its first words."""
        assert self.token_store is not None  # errors name documents once they are stored
        assert self.tokenizer is not None  # store() sets it with the store
        start = int(self.token_store.offsets[document])
        first = self.token_store.tokens[start : start + 80].tolist()
        return describe_text(self.tokenizer.decode(first))

    # -- the token store ---------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        if self.tokenizer is None:
            self.setup()
        assert self.tokenizer is not None  # setup built the store, and with it the tokenizer
        return self.tokenizer.vocab_size

    def prepare_data(self) -> None:
        """Build the token store before every rank's setup maps it, when there is a cache folder.

        Without one each rank builds its own.
        """
        if self.cache_dir is not None:
            self.store()

    def store(self) -> TokenStore:
        """The token store of the source, tokenizer and options, built unless found.

        Sets `self.tokenizer` (trained or loaded) unless a checkpoint's state set it. A data
        mixture's sources are its parts, stored one after another.
        """
        if self.token_store is not None:
            return self.token_store
        parts = self.source.store_parts()
        contents = "+".join(content_fingerprint(files) for files in parts)
        source = f"{type(self).__name__}|{contents}|{self.source_options()}"
        folder = self._store_folder()
        with TemporaryDirectory(dir=folder, prefix=f".work-{builder_name()}.") as work:
            corpora = cache(partial(self._read_parts, parts, Path(work)))
            if self.tokenizer is None:
                self.tokenizer = build_tokenizer(
                    **self.tokenizer_options,
                    training_texts=lambda: self._training_split_texts(corpora()),
                    cache_dir=self.cache_dir,
                    cache_key=f"{source}|{self.split_seed}|{self.fractions}",
                )
            fingerprint = self.tokenizer.fingerprint
            key = hashlib.sha256(f"{STORE_FORMAT}|{source}|{fingerprint}".encode()).hexdigest()
            files = [file for files in parts for file in files]
            self.token_store = load_or_build(
                folder,
                key[:20],
                lambda staging: self._write_store(corpora(), staging, key[:20]),
                what=str(files[0]) if len(files) == 1 else f"{len(files)} files",
            )
        return self.token_store

    def resolve(self, paths: list[str], key: str) -> list[Path]:
        """The files `paths` name (the config key `key`), hf:// datasets fetched by `hub`."""
        return resolve_files(paths, key=key, hub=self.hub)

    def _read_parts(self, parts: list[list[Path]], work_dir: Path) -> list[datasets.Dataset]:
        return [self.read_corpus(files, work_dir / f"part-{n}") for n, files in enumerate(parts)]

    def _store_folder(self) -> Path:
        if self.cache_dir is not None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            return self.cache_dir
        if self._scratch is None:
            self._scratch = TemporaryDirectory(prefix="token-store-")
        return Path(self._scratch.name)

    def _training_split_texts(self, corpora: list[datasets.Dataset]) -> Iterator[str]:
        counts = [len(corpus) for corpus in corpora]
        train = self.source.split_documents(counts)["train"]
        for part, (corpus, start) in enumerate(
            zip(corpora, np.cumsum([0, *counts[:-1]]), strict=True)
        ):
            mine = train[(train >= start) & (train < start + len(corpus))]
            yield from self.training_texts(corpus, mine - start, part)

    def _write_store(self, corpora: list[datasets.Dataset], staging: Path, key: str) -> None:
        """Tokenise with `Dataset.map` and copy its Arrow columns into the store.

        `datasets` caches `map` by fingerprint too, but it fingerprints local files by name and
        time, not content, and keeps tokens as Arrow lists next to the text. The store goes
        further: keyed by content, checked against its manifest when opened, smallest dtype,
        and read with numpy alone; `map` runs in a work folder deleted once the store is
        written, so the corpus is not kept tokenised twice. Its output files are read batch by
        batch rather than mapped, and `.txt` corpora are tokenised a part at a time, so that
        neither leaves the corpus resident.
        """
        assert self.tokenizer is not None  # store() sets it before writing
        writer = StoreWriter(staging, key, self.tokenizer.vocab_size, self.has_targets)
        for source, corpus in enumerate(corpora):
            for number, part in enumerate(separately_mapped_parts(corpus)):
                for batch in self._tokenised(part, source, f"{key}-{source}-{number}"):
                    tokens, lengths = flat_column(batch.column("input_ids"))
                    targets = flat_column(batch.column("targets"))[0] if self.has_targets else None
                    writer.add(tokens, lengths, targets)
        counts = [len(corpus) for corpus in corpora]
        parts = {"part_documents": counts} if len(counts) > 1 else {}
        writer.finish(tokenizer=self.tokenizer.fingerprint, **parts)
        log.info("Tokenised %d documents into %s", sum(counts), staging.parent)

    def _tokenised(
        self, part: datasets.Dataset, source: int, fingerprint: str
    ) -> Iterator[pa.RecordBatch]:
        """The record batches `Dataset.map` writes for `part` of store part `source`, in order.

        Each file is deleted once read (the store keeps the tokens).
        """
        cheap = self.tokenising_is_cheap()
        workers = 1 if cheap else min(self.num_proc, len(part) // ROWS_PER_WORKER)
        tokenized = part.with_format("arrow").map(
            self.encoder(source),
            batched=True,
            with_indices=True,
            num_proc=workers if workers > 1 else None,
            remove_columns=part.column_names,
            new_fingerprint=fingerprint,
        )
        for cache_file in tokenized.cache_files:
            with pa.OSFile(cache_file["filename"]) as source:
                yield from pa.ipc.open_stream(source)
            os.remove(cache_file["filename"])

    # -- setup -------------------------------------------------------------------------------

    @property
    def datasets(self) -> dict[str, PackedRows]:
        """The rows of each split the token store serves, once set up."""
        return self.source.datasets

    @property
    def accounting(self) -> dict[str, TokenAccounting]:
        """What the over-long policy did to each split's tokens, the training rows' included."""
        return self.source.accounting

    def setup(self, stage: str | None = None) -> None:
        if not self.datasets:
            self._set_up_source()

    def _set_up_source(self) -> None:
        self.source.setup(self.store())
        self._log_summary()

    def store_splits(
        self, store: TokenStore, splits: dict[str, np.ndarray]
    ) -> tuple[dict[str, PackedRows], dict[str, TokenAccounting]]:
        """The rows of each split's documents of `store`, with what fitting did to their tokens.

        The documents are fitted to `max_seq_len` by `overlong` and packed (or one a row).
        """
        lengths = store.lengths()
        rows, accounting = {}, {}
        for split, documents in splits.items():

            def describe(i: int, documents: np.ndarray = documents) -> str:
                return self.describe(int(documents[i]))

            pieces, accounting[split] = fit_to_length(
                lengths[documents], self.max_seq_len, self.overlong, describe=describe
            )
            if split != "test" and not len(pieces):
                raise DataError(
                    no_samples_left(split, lengths[documents], self.max_seq_len, self.has_targets)
                )
            pieces = replace(pieces, sample=documents[pieces.sample])
            rows[split] = PackedRows(store, pieces, self.rows_of(pieces.length))
        return rows, accounting

    def rows_of(self, lengths: np.ndarray) -> Rows:
        if not self.packing:
            return Rows.one_per_row(len(lengths))
        return pack(lengths, self.max_seq_len, self.packing_strategy)

    def packing_metrics(self) -> dict[str, float]:
        """Rows, padding fraction and documents per row of the training rows."""
        return self.source.packing_metrics()

    def row_metrics(self, lengths: np.ndarray, samples: int) -> dict[str, float]:
        """The packing metrics of rows holding `lengths` real tokens and `samples` samples in all.

        Packed rows are `max_seq_len` slots; padded rows as long as their batch's longest.
        """
        if self.packing:
            slots = len(lengths) * self.max_seq_len
        else:  # padded in consecutive batches of this many rows (the shuffle changes little)
            starts = np.arange(0, len(lengths), self.batch_size)
            sizes = np.diff(np.append(starts, len(lengths)))
            slots = int((np.maximum.reduceat(lengths, starts) * sizes).sum()) if len(starts) else 0
        return {
            "data/rows": len(lengths),
            "data/padding_fraction": 1 - int(lengths.sum()) / max(1, slots),
            "data/documents_per_row": samples / max(1, len(lengths)),
        }

    def _log_summary(self) -> None:
        for split, dataset in self.datasets.items():
            accounting = self.accounting[split]
            log.info(
                "%s: %d samples in %d rows (%d tokens kept, %d truncated, %d dropped)",
                split,
                len(dataset.pieces),
                len(dataset),
                accounting.kept,
                accounting.truncated,
                accounting.dropped,
            )

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What checkpoints keep of the datamodule.

        Its tokenizer, as plain strings, and what its source needs to resume.
        """
        state = self.source.state_dict()
        return (
            state
            if self.tokenizer is None
            else {**state, "tokenizer": tokenizer_state(self.tokenizer)}
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check that the source can resume, then use the checkpoint's tokenizer.

        Lightning calls this after `setup` when it resumes, before training: a tokenizer that
        differs from the one setup built (a BPE retrained, a changed folder) replaces it, and
        the documents are tokenised again with it.
        """
        self.source.check_resume(state_dict)
        if "tokenizer" not in state_dict:
            if self.tokenizer is None:
                self.tokenizer = self._tokenizer_of_older_checkpoint()
            return
        stored = tokenizer_from_state(state_dict["tokenizer"])
        if self.tokenizer is not None and self.tokenizer.fingerprint == stored.fingerprint:
            return
        self.tokenizer = stored
        self.token_store = None
        if self.datasets:
            log.warning("The checkpoint's tokenizer differs from this run's: tokenising again")
            self._set_up_source()

    def _tokenizer_of_older_checkpoint(self) -> ByteTokenizer | FileTokenizer:
        """The tokenizer of a checkpoint from before tokenizers were kept in checkpoints.

        That is possible when the config alone rebuilds it (bytes, or a pretrained folder).
        """
        if self.tokenizer_options.get("kind", "auto") == "bpe":
            raise CheckpointError(
                "The checkpoint predates tokenizers in checkpoints, and its BPE tokenizer was "
                "trained during the run. Pass the run's tokenizer/ folder: --tokenizer <run "
                "dir>/tokenizer to scripts/generate.py, or the overrides "
                "data.tokenizer.kind=pretrained data.tokenizer.path=<run dir>/tokenizer."
            )
        return build_tokenizer(**self.tokenizer_options)

    # -- loaders -----------------------------------------------------------------------------

    @property
    def source_names(self) -> tuple[str, ...]:
        """The sources of `data.mixture`, whose validation and test loaders come in this order."""
        return self.source.names

    def _loader(
        self, split: str, batch_size: int, shuffle: bool
    ) -> StatefulDataLoader | list[StatefulDataLoader]:
        return self.source.loader(split, batch_size, shuffle)

    def split_loader(self, rows: PackedRows, batch_size: int, shuffle: bool) -> StatefulDataLoader:
        """The resumable loader of a split's stored rows (shuffled for training).

        With `bucket_by_length` it loads whole batches of similar lengths.
        """
        unit = "rows" if self.packing else "documents"
        if self.bucket_by_length:  # items are whole batches
            if shuffle:  # the batches are formed before the ranks share them out
                check_one_batch(len(rows), batch_size, unit=unit)
            batches = BucketedBatches(rows, batch_size, self.split_seed, drop_last=shuffle)
            return resumable_loader(self, batches, None, shuffle, collate_fn=self.collate())
        return resumable_loader(self, rows, batch_size, shuffle, unit, collate_fn=self.collate())

    def collate(self) -> Callable[[list], dict[str, torch.Tensor]]:
        """`collate_rows` for this module's rows: packed rows of `max_seq_len`, or padded."""
        assert self.tokenizer is not None  # loaders are built after setup
        return partial(
            collate_rows,
            pad_id=self.tokenizer.pad_token_id,
            row_length=self.max_seq_len if self.packing else None,
            pad_to_multiple_of=self.pad_to_multiple_of,
        )
