"""Pretraining text: local files, globs or folders of documents, each trained on alone."""

import re
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa

from src.data.corpus.encoding import append_token, list_column
from src.data.corpus.readers import read_documents
from src.data.corpus.token_store import token_dtype
from src.data.corpus.tokenizers import ByteTokenizer
from src.data.text.packed_text import PackedTextDataModule
from src.data.text.sources.mixed import MixedSource
from src.data.text.sources.mixture import as_list, parse_mixture
from src.data.text.sources.streamed import StreamedSource
from src.utils.errors import ConfigError

# Named rules for cutting a .txt file into documents; any other value is a regular expression.
DOCUMENT_SPLITS = {"blank_line": r"\n[ \t]*\n", "line": r"\n", "file": None}
# What becomes of JSON and Parquet rows without the text field: refused, or left out.
MISSING_TEXT = ("raise", "skip")


class TextDataModule(PackedTextDataModule):
    """Documents from the `.txt`, `.jsonl`/`.json` and `.parquet` files of `paths`.

    `.txt` files are cut by `document_split` (`blank_line`: paragraphs, Tiny Shakespeare's
    speeches; `line`; `file`, one document per file; or a regular expression); the others give
    the `text_field` of every row, and a row without it (missing or null) stops the run unless
    `missing_text="skip"` leaves such rows out. A path may be a file, a glob or a folder (its
    files of those formats, in name order). Each document is followed by the tokenizer's
    end-of-text token, the last target it is trained on.

    Over-long documents are split by default: every token is trained on, and a continuation
    keeps its positions though it cannot attend to the piece before it.

    With `streaming`, the training documents are read from `paths` as the run goes, never
    stored (`StreamedSource`): packed `packing_buffer` documents at a time, sharded by file
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
        missing_text: str = "raise",
        streaming: bool = False,
        packing_buffer: int = 1000,
        val_paths: str | list[str] | None = None,
        mixture: list[dict[str, Any]] | None = None,
        **options,
    ):
        super().__init__(**options)
        if mixture is not None:
            if val_paths is not None:
                raise ConfigError(
                    "data.val_paths and data.mixture both name held-out files: give each "
                    "source its own, data.mixture[i].val_paths"
                )
            sources = parse_mixture(mixture, streaming)
            self.source = MixedSource(self, sources, packing_buffer if streaming else None)
        elif streaming:
            held_out = None if val_paths is None else as_list(val_paths)
            self.source = StreamedSource(self, packing_buffer, held_out)
        self.paths = as_list(paths)
        self.document_split = document_split
        self.text_field = text_field
        if missing_text not in MISSING_TEXT:
            raise ConfigError(
                f"data.missing_text={missing_text!r} is not one of {', '.join(MISSING_TEXT)}"
            )
        self.missing_text = missing_text
        pattern = DOCUMENT_SPLITS.get(document_split, document_split)
        try:
            self.separator = None if pattern is None else re.compile(pattern)
        except re.error as error:
            raise ConfigError(
                f"data.document_split={document_split!r} is neither one of "
                f"{list(DOCUMENT_SPLITS)} nor a regular expression ({error})"
            ) from error

    def source_files(self) -> list[Path]:
        return self.resolve(self.paths, "data.paths")

    def source_options(self) -> str:
        # With missing_text, a store built before rows without text were refused is not reused.
        return f"{self.document_split}|{self.text_field}|{self.missing_text}"

    def read_corpus(self, files: list[Path], work_dir: Path) -> datasets.Dataset:
        return read_documents(files, self.separator, self.text_field, work_dir, self.missing_text)

    def training_texts(
        self, corpus: datasets.Dataset, rows: np.ndarray, part: int = 0
    ) -> Iterator[str]:
        for batch in corpus.select(rows).iter(batch_size=1000):
            yield from batch["text"]

    def tokenising_is_cheap(self) -> bool:
        """Bytes are: their ids are the text's UTF-8 buffer.

        100 MB take 2.3 s in one process and 5 s in two, measured in docs/BENCHMARKS.md's
        machine.
        """
        return isinstance(self.tokenizer, ByteTokenizer)

    def encoder(self, part: int = 0):
        return partial(encode_documents, tokenizer=self.tokenizer)


def encode_documents(table: pa.Table, indices: list[int], tokenizer) -> pa.Table:
    """`Dataset.map`'s function: each document's token ids, then the end-of-text token."""
    values, lengths = tokenizer.encode_batch(table["text"])
    tokens = append_token(values, lengths, tokenizer.eos_token_id)
    dtype = token_dtype(tokenizer.vocab_size)
    return pa.table({"input_ids": list_column(tokens, lengths + 1, dtype)})
