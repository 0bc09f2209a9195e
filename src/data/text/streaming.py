"""Pretraining documents streamed from their files rather than tokenised into a store first.

This is for corpora that do not fit on one disk, on local disks or behind URLs (fsspec:
`s3://`, `gs://`, `hf://`).

Files are read lazily through `datasets`' iterable datasets, one file a shard; shards go to
ranks (`split_dataset_by_node`) and, inside a rank, to data-loader workers (`datasets` does it
in each worker). Each worker tokenises its documents a buffer at a time, applies the over-long
policy, packs the buffer and yields its rows, shuffled, as the `Sample`s that `collate_rows`
turns into a batch, the same samples the token store would give. When a pass over the files
ends the next one starts, the files in a new order: the stream never ends, so every rank
yields as many batches as the run asks for.

A worker's position is the state of its `datasets` iterator at the start of its current
buffer, the pass and buffer numbers, and how many of the buffer's rows it has yielded: a
resumed run reads that buffer again, packs it the same way and skips the rows already yielded.
"""

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from datasets.distributed import split_dataset_by_node
from torch.utils.data import IterableDataset, get_worker_info

from src.data.corpus.encoding import flat_column
from src.data.corpus.readers import (
    FORMATS,
    check_text_field,
    file_exists,
    open_file,
    text_documents,
)
from src.data.corpus.rows import PackedRows
from src.data.packing.packing import (
    Pieces,
    Rows,
    Sample,
    TokenAccounting,
    describe_text,
    fit_to_length,
    pack,
)
from src.utils.errors import ConfigError, DataError

TEXT = datasets.Features({"text": datasets.Value("string")})


def stream_format(files: list[str]) -> str:
    """The one format (`text`, `json`, `parquet`) of the files a stream reads."""
    kinds = {FORMATS[Path(file).suffix] for file in files}
    if len(kinds) > 1:
        raise ConfigError(
            f"data.streaming=true reads files of one format, but data.paths mixes {sorted(kinds)}"
        )
    return kinds.pop()


def document_stream(
    files: list[str], separator: re.Pattern | None, text_field: str
) -> datasets.IterableDataset:
    """The documents of `files` (local paths or URLs), in order, as an iterable dataset.

    It has one column `text` and one shard per file: `.txt` files cut by `separator` and
    stripped as the store cuts them, JSON and Parquet rows' `text_field`.
    """
    paths = [str(path) for path in files]
    kind = stream_format(files)
    if kind == "text":
        return datasets.IterableDataset.from_generator(
            _text_file_documents,
            gen_kwargs={"paths": paths, "separator": separator},
            features=TEXT,
        )
    if kind == "parquet":
        with open_file(paths[0]) as file:
            check_text_field(paths[0], text_field, pq.read_schema(file).names)
        return datasets.IterableDataset.from_generator(
            _parquet_documents, gen_kwargs={"paths": paths, "column": text_field}, features=TEXT
        )
    records = datasets.load_dataset(kind, data_files=paths, streaming=True, split="train")
    check_text_field(paths[0], text_field, records.column_names or list(next(iter(records))))
    records = records.select_columns([text_field])
    return records.rename_column(text_field, "text") if text_field != "text" else records


def _parquet_documents(paths: list[str], column: str) -> Iterator[dict]:
    """The `column` of each file's rows, 1,000 rows read at a time.

    `datasets`' own Parquet stream converts a whole row group at once, which held about 300 MB
    at 1 GB of shards (docs/BENCHMARKS.md).
    """
    for path in paths:
        with open_file(path) as file:
            for batch in pq.ParquetFile(file).iter_batches(batch_size=1000, columns=[column]):
                yield from ({"text": text} for text in batch.column(0).to_pylist())


def _text_file_documents(paths: list[str], separator: re.Pattern | None) -> Iterator[dict]:
    for path in paths:
        for documents in text_documents(path, separator):
            yield from ({"text": document} for document in documents)


class StreamedRows(IterableDataset):
    """Rows of `max_seq_len` tokens from the documents of `files`, for rank `rank` of `world_size`.

    There is one document a row when not `packing`; the rows come endlessly, or for `passes`
    passes.

    `encoder` is the datamodule's `Dataset.map` function (an Arrow table with a `text` column
    in, `input_ids` out). `buffer_documents` documents are fitted and packed together; their
    rows are shuffled by `seed`, the pass, the buffer, the rank and the worker (kept in order
    when not `shuffle`). Pass p reads the files in an order drawn from `seed` and p. A row
    without text stops the stream unless `missing_text="skip"`.

    `run_rows`, when set, is the length the stream reports: the rows the run reads. A training
    loader of known length is one Lightning does not read a batch ahead of the step it trains
    (as it does to find the end of an unsized one), so the loader position a checkpoint keeps
    is the step's own.
    """

    def __init__(
        self,
        files: list[str],
        separator: re.Pattern | None,
        text_field: str,
        encoder: Callable[[pa.Table, list[int]], pa.Table],
        max_seq_len: int,
        overlong: str,
        packing: bool,
        packing_strategy: str,
        buffer_documents: int,
        seed: int,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        passes: int | None = None,
        missing_text: str = "raise",
    ):
        self.files = list(files)
        self.separator = separator
        self.text_field = text_field
        self.encoder = encoder
        self.max_seq_len = max_seq_len
        self.overlong = overlong
        self.packing = packing
        self.packing_strategy = packing_strategy
        self.buffer_documents = buffer_documents
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.passes = passes
        self.missing_text = missing_text
        self.run_rows: int | None = None
        self.position = self._start_of_pass(0)
        stream_format(self.files)  # mixed formats and a missing text_field stop here, not later
        document_stream(self.files[:1], separator, text_field)

    # -- shards ------------------------------------------------------------------------------

    @property
    def shards_per_rank(self) -> int:
        """Files each rank reads: a share when the ranks divide the files evenly, else every file.

        Reading every file, each rank keeps one document in `world_size` (what `datasets` does).
        """
        count = len(self.files)
        return count // self.world_size if count % self.world_size == 0 else count

    def check_workers(self, num_workers: int) -> None:
        """Every worker of every rank needs a shard of its own, or it would have nothing to read."""
        if self.shards_per_rank < max(1, num_workers):
            raise ConfigError(
                f"data.paths has {len(self.files)} files, {self.shards_per_rank} for each of "
                f"{self.world_size} ranks, fewer than data.num_workers={num_workers}: lower "
                f"data.num_workers or split the corpus into more files"
            )

    def pass_files(self, number: int) -> list[str]:
        """The files in the order pass `number` reads them."""
        if not self.shuffle:
            return self.files
        order = np.random.default_rng([self.seed, number]).permutation(len(self.files))
        return [self.files[i] for i in order]

    def _pass_stream(self, number: int) -> datasets.IterableDataset:
        self._check_files_exist()
        with self._naming_vanished_shards():
            stream = document_stream(self.pass_files(number), self.separator, self.text_field)
        if self.world_size > 1:
            stream = split_dataset_by_node(stream, rank=self.rank, world_size=self.world_size)
        return stream

    def _check_files_exist(self) -> None:
        for path in self.files:
            if not file_exists(path):
                raise DataError(
                    f"data.paths: the shard {path} vanished while streaming; restore it or "
                    f"remove it from data.paths"
                )

    @contextmanager
    def _naming_vanished_shards(self) -> Iterator[None]:
        """Reading errors as one-line DataErrors, naming the shard when one disappeared."""
        try:
            yield
        except DataError:
            raise
        except (OSError, pa.ArrowException) as error:
            self._check_files_exist()
            raise DataError(f"data.paths: a shard cannot be streamed ({error})") from None

    # -- the stream --------------------------------------------------------------------------

    def __len__(self) -> int:
        if self.run_rows is None:
            raise TypeError("an endless stream has no length until the run's is set")
        return self.run_rows

    def __iter__(self) -> Iterator[list[Sample]]:
        worker = get_worker_info()
        worker_id = worker.id if worker is not None else 0
        while self.passes is None or self.position["pass"] < self.passes:
            number = self.position["pass"]
            stream = self._pass_stream(number)
            if self.position["documents"] is not None:
                stream.load_state_dict(self.position["documents"])
            documents = iter(stream)
            while texts := self._next_buffer(documents):
                rows = self.buffer_rows(texts, self._row_seed(number, worker_id))[0]
                for index in range(self.position["rows"], len(rows)):
                    self.position["rows"] = index + 1  # before the yield: what state_dict sees
                    yield rows[index]
                self.position = {
                    "pass": number,
                    "buffer": self.position["buffer"] + 1,
                    "documents": stream.state_dict(),
                    "rows": 0,
                }
            if self.position["buffer"] == 0:
                raise DataError(
                    f"data.paths: the {len(self.files)} files hold no document for rank "
                    f"{self.rank}, worker {worker_id}; add text or lower data.num_workers"
                )
            self.position = self._start_of_pass(number + 1)

    def _next_buffer(self, documents: Iterator[dict]) -> list[str]:
        """The next `buffer_documents` non-blank texts (fewer at the end of the pass).

        A file that disappeared is named; a row without text stops the stream, unless
        `missing_text="skip"` leaves such rows out.
        """
        texts = []
        with self._naming_vanished_shards():
            for record in documents:
                if record["text"] is None and self.missing_text != "skip":
                    raise DataError(
                        f"data.paths: a row of the {len(self.files)} streamed files has no "
                        f"{self.text_field!r} (missing or null): point data.text_field at the "
                        f"column that holds the text, or pass data.missing_text=skip to train "
                        f"without such rows"
                    )
                if record["text"] and record["text"].strip():
                    texts.append(record["text"])
                    if len(texts) == self.buffer_documents:
                        break
        return texts

    def _row_seed(self, number: int, worker_id: int) -> list[int] | None:
        if not self.shuffle:
            return None
        return [self.seed, number, self.position["buffer"], self.rank, worker_id]

    def buffer_rows(
        self, texts: list[str], seed: list[int] | None = None
    ) -> tuple[list[list[Sample]], Pieces, TokenAccounting]:
        """The rows of one buffer of documents (shuffled by `seed` unless None).

        With them come the pieces they hold and the over-long policy's accounting.
        """
        encoded = self.encoder(pa.table({"text": pa.array(texts, pa.large_string())}), [])
        tokens, lengths = flat_column(encoded.column("input_ids").combine_chunks())
        offsets = np.concatenate(([0], np.cumsum(lengths)))
        pieces, accounting = fit_to_length(
            lengths, self.max_seq_len, self.overlong, describe=lambda i: describe_text(texts[i])
        )
        rows = (
            pack(pieces.length, self.max_seq_len, self.packing_strategy)
            if self.packing
            else Rows.one_per_row(len(pieces))
        )
        buffer = PackedRows(BufferTokens(tokens, offsets), pieces, rows)
        order: range | np.ndarray = range(len(rows))
        if seed is not None:
            order = np.random.default_rng(seed).permutation(len(rows))
        return [buffer[int(row)] for row in order], pieces, accounting

    def first_buffer(self) -> tuple[list[list[Sample]], Pieces, TokenAccounting]:
        """The rows of this rank's first buffer, read apart from the stream.

        They are what the run's report shows of the data.
        """
        documents = iter(self._pass_stream(0))
        return self.buffer_rows(self._next_buffer(documents))

    # -- checkpoints -------------------------------------------------------------------------

    @staticmethod
    def _start_of_pass(number: int) -> dict[str, Any]:
        return {"pass": number, "buffer": 0, "documents": None, "rows": 0}

    def state_dict(self) -> dict[str, Any]:
        """Where this worker is: see the module docstring."""
        return dict(self.position)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.position = dict(state_dict)


class BufferTokens:
    """One buffer's tokens as `PackedRows` reads a store's.

    Documents are back to back, document i at tokens[offsets[i]:offsets[i + 1]], and every
    token is a target (pretraining).
    """

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray):
        self.tokens, self.offsets = tokens, offsets

    def read(self, begin: int, end: int) -> tuple[np.ndarray, None]:
        return self.tokens[begin:end], None
