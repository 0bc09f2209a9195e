"""Pretraining text: local files, globs or folders of documents, each trained on alone."""

import logging
import re
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from src.data.corpus.encoding import append_token, list_column
from src.data.corpus.readers import read_documents, resolve_files, resolve_stream_files
from src.data.corpus.token_store import token_dtype
from src.data.corpus.tokenizers import ByteTokenizer
from src.data.text.packed_text import PackedTextDataModule
from src.data.text.streaming import StreamedRows
from src.utils.errors import ConfigError

log = logging.getLogger(__name__)

# Named rules for cutting a .txt file into documents; any other value is a regular expression.
DOCUMENT_SPLITS = {"blank_line": r"\n[ \t]*\n", "line": r"\n", "file": None}


class TextDataModule(PackedTextDataModule):
    """Documents from `paths`: `.txt` files cut by `document_split` (`blank_line`: paragraphs,
    Tiny Shakespeare's speeches; `line`; `file`, one document per file; or a regular
    expression), and the `text_field` of every row of `.jsonl`/`.json` and `.parquet` files.
    A path may be a file, a glob or a folder (its files of those formats, in name order). Each
    document is followed by the tokenizer's end-of-text token, the last target it is trained on.

    Over-long documents are split by default: every token is trained on, and a continuation
    keeps its positions though it cannot attend to the piece before it.

    With `streaming`, the training documents are read from `paths` as the run goes, never
    stored (`src.data.text.streaming`): packed `packing_buffer` documents at a time, sharded by file
    across ranks and workers, endlessly (the run's length is `trainer.max_steps`). Validation
    and test then come from the held-out files `val_paths`, through the token store: their
    documents are split between the two in the ratio `val_fraction`:`test_fraction`.
    """

    default_overlong = "split"

    def __init__(
        self,
        paths: str | list[str],
        document_split: str = "blank_line",
        text_field: str = "text",
        streaming: bool = False,
        packing_buffer: int = 1000,
        val_paths: str | list[str] | None = None,
        **options,
    ):
        super().__init__(**options)
        if streaming:
            check_streaming_options(packing_buffer, val_paths, self.tokenizer_options)
            if self.bucket_by_length:
                raise ConfigError("data.bucket_by_length sorts the whole corpus: set it false")
        self.streaming = streaming
        self.packing_buffer = packing_buffer
        self.val_paths = None if val_paths is None else as_list(val_paths)
        self.stream: StreamedRows | None = None
        self._stream_tokenizer = None  # the tokenizer the stream encodes with
        self._first_rows: list = []
        self.paths = as_list(paths)
        self.document_split = document_split
        self.text_field = text_field
        pattern = DOCUMENT_SPLITS.get(document_split, document_split)
        try:
            self.separator = None if pattern is None else re.compile(pattern)
        except re.error as error:
            raise ConfigError(
                f"data.document_split={document_split!r} is neither one of "
                f"{list(DOCUMENT_SPLITS)} nor a regular expression ({error})"
            ) from error

    def source_files(self) -> list[Path]:
        """The files of the token store: the held-out files when streaming."""
        if self.streaming:
            return resolve_files(self.val_paths, key="data.val_paths")
        return resolve_files(self.paths)

    def source_options(self) -> str:
        return f"{self.document_split}|{self.text_field}"

    def read_corpus(self, files: list[Path], work_dir: Path) -> datasets.Dataset:
        return read_documents(files, self.separator, self.text_field, work_dir)

    def training_texts(self, corpus: datasets.Dataset, rows: np.ndarray) -> Iterator[str]:
        for batch in corpus.select(rows).iter(batch_size=1000):
            yield from batch["text"]

    def tokenising_is_cheap(self) -> bool:
        """Bytes are: their ids are the text's UTF-8 buffer (100 MB take 2.3 s in one process
        and 5 s in two, measured in docs/BENCHMARKS.md's machine)."""
        return isinstance(self.tokenizer, ByteTokenizer)

    def encoder(self):
        return partial(encode_documents, tokenizer=self.tokenizer)

    # -- streaming ---------------------------------------------------------------------------

    def split_documents(self, count: int) -> dict[str, np.ndarray]:
        """Streaming: the held-out documents, split between validation and test (no training
        split: the stream is one)."""
        if not self.streaming:
            return super().split_documents(count)
        order = torch.randperm(count, generator=torch.Generator().manual_seed(self.split_seed))
        share = self.fractions["val"] / (self.fractions["val"] + self.fractions["test"])
        val = max(1, round(count * share))
        order = order.numpy()
        return {"val": np.sort(order[:val]), "test": np.sort(order[val:])}

    def setup(self, stage: str | None = None) -> None:
        """Streaming: validation and test from the store of `val_paths`, and the training
        stream, rebuilt when a checkpoint's tokenizer replaced this run's."""
        super().setup(stage)
        if self.streaming and self._stream_tokenizer is not self.tokenizer:
            self.stream = self.training_stream()
            self._stream_tokenizer = self.tokenizer
            self._first_rows, _, self.accounting["train"] = self.stream.first_buffer()

    def training_stream(self) -> StreamedRows:
        """This rank's endless stream of training rows."""
        trainer = self.trainer
        world_size, rank = (trainer.world_size, trainer.global_rank) if trainer else (1, 0)
        seed = torch.initial_seed() if self.shuffle_seed is None else self.shuffle_seed
        stream = StreamedRows(
            resolve_stream_files(self.paths),
            self.separator,
            self.text_field,
            self.encoder(),
            self.max_seq_len,
            self.overlong,
            self.packing,
            self.packing_strategy,
            self.packing_buffer,
            seed % 2**63,
            rank=rank,
            world_size=world_size,
        )
        stream.check_workers(self.num_workers)
        if world_size > 1 and stream.shards_per_rank == len(stream.files):
            log.warning(
                "data.paths has %d files, which %d ranks do not share evenly: every rank reads "
                "every file and keeps 1 document in %d",
                len(stream.files),
                world_size,
                world_size,
            )
        return stream

    def packing_metrics(self) -> dict[str, float]:
        """Streaming: the metrics of the stream's first buffer (the rest is yet to be read)."""
        if not self.streaming:
            return super().packing_metrics()
        lengths = np.array([sum(map(len, row)) for row in self._first_rows], dtype=np.int64)
        return self.row_metrics(lengths, sum(map(len, self._first_rows)))

    def _loader(self, split: str, batch_size: int, shuffle: bool) -> StatefulDataLoader:
        if not (self.streaming and split == "train"):
            return super()._loader(split, batch_size, shuffle)
        self._set_run_length()
        return StatefulDataLoader(
            self.stream,
            batch_size=batch_size,
            collate_fn=self.collate(),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def _set_run_length(self) -> None:
        """An endless stream needs the run to say when it ends: it reads that many rows."""
        trainer = self.trainer
        if trainer is None:
            return
        if trainer.max_steps is None or trainer.max_steps < 0:
            raise ConfigError(
                "data.streaming=true streams endlessly: set trainer.max_steps to the run's "
                "length (and trainer.max_epochs=-1)"
            )
        batches = trainer.max_steps * trainer.accumulate_grad_batches
        self.stream.run_rows = batches * self.batch_size


def as_list(paths: str | Path | list[str]) -> list[str]:
    return [str(p) for p in ([paths] if isinstance(paths, str | Path) else paths)]


def check_streaming_options(packing_buffer: int, val_paths, tokenizer_options: dict) -> None:
    """What streaming cannot do: one-line ConfigErrors saying what to set instead."""
    if packing_buffer < 1:
        raise ConfigError(f"data.packing_buffer must be a positive integer, got {packing_buffer}")
    if val_paths is None:
        raise ConfigError(
            "data.streaming=true validates on held-out files: set data.val_paths=[<files, globs "
            "or folders>]"
        )
    if tokenizer_options.get("kind") == "bpe":
        raise ConfigError(
            "data.tokenizer.kind=bpe trains on the corpus, which streaming never holds: train "
            "it once in a run without data.streaming, then pass data.tokenizer.kind=pretrained "
            "data.tokenizer.path=<run dir>/tokenizer"
        )


def encode_documents(table: pa.Table, indices: list[int], tokenizer) -> pa.Table:
    """`Dataset.map`'s function: each document's token ids, then the end-of-text token."""
    values, lengths = tokenizer.encode_batch(table["text"])
    tokens = append_token(values, lengths, tokenizer.eos_token_id)
    dtype = token_dtype(tokenizer.vocab_size)
    return pa.table({"input_ids": list_column(tokens, lengths + 1, dtype)})
