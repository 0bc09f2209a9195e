"""The streamed token source (`data.streaming=true`): training rows read as the run goes.

The training rows are read from `data.paths` (`src.data.text.streaming`), validation and test
from the token store of the held-out files `data.val_paths`.
"""

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from src.data.corpus.readers import resolve_stream_files
from src.data.corpus.rows import PackedRows
from src.data.corpus.token_store import TokenStore
from src.data.packing.packing import Sample, TokenAccounting
from src.data.text.sources.mixture import MixedStream, check_same_mixture
from src.data.text.sources.token_source import shuffled_documents
from src.data.text.streaming import StreamedRows
from src.utils.errors import ConfigError

if TYPE_CHECKING:  # the datamodule builds its source: imported for the types only
    from src.data.text.packed_text import PackedTextDataModule
    from src.data.text.pretraining import TextDataModule

log = logging.getLogger(__name__)


class StreamedSource:
    """The `TokenSource` of a corpus too large to store, whose training documents are streamed.

    The training documents of `paths` are streamed, packed `packing_buffer` documents at a
    time, sharded by file across ranks and workers, endlessly (the run's length is
    `trainer.max_steps`); the documents of `val_paths` are stored and split between validation
    and test in the ratio `val_fraction`:`test_fraction`.

    The stream's position is each loader worker's state (`StreamedRows.state_dict`), which
    Lightning keeps in the checkpoint's loop state: a resumed run continues mid-buffer.
    """

    names: tuple[str, ...] = ()  # one source
    stream: StreamedRows  # this rank's training rows, from setup on

    def __init__(self, module: "TextDataModule", packing_buffer: int, val_paths: list[str] | None):
        """Refuses, in one line saying what to set instead, what streaming cannot do."""
        check_streaming(module, packing_buffer)
        if val_paths is None:
            raise ConfigError(
                "data.streaming=true validates on held-out files: set data.val_paths=[<files, "
                "globs or folders>]"
            )
        self.module = module
        self.packing_buffer = packing_buffer
        self.val_paths = val_paths
        self.datasets: dict[str, PackedRows] = {}
        self.accounting: dict[str, TokenAccounting] = {}
        self.first_rows: list[list[Sample]] = []  # the first buffer's, for the data report

    def store_parts(self) -> list[list[Path]]:
        return [self.module.resolve(self.val_paths, "data.val_paths")]

    def split_documents(self, counts: Sequence[int]) -> dict[str, np.ndarray]:
        """The held-out documents, split between validation and test.

        There is no training split: the stream is one.
        """
        return split_held_out(sum(counts), self.module.fractions, self.module.split_seed)

    def setup(self, store: TokenStore) -> None:
        """The held-out splits from `store`, and the training stream.

        The stream's first buffer stands for its accounting (the rest is yet to be read).
        """
        splits = self.split_documents(store.part_documents)
        self.datasets, self.accounting = self.module.store_splits(store, splits)
        self.stream = rank_stream(self.module, self.module.paths, self.packing_buffer)
        self.first_rows, _, self.accounting["train"] = self.stream.first_buffer()

    def loader(self, split: str, batch_size: int, shuffle: bool) -> StatefulDataLoader:
        """The stream for training; the stored rows for validation and test."""
        if split != "train":
            return self.module.split_loader(self.datasets[split], batch_size, shuffle)
        return stream_loader(self.module, self.stream, batch_size)

    def state_dict(self) -> dict[str, Any]:
        """The number of loader workers: each keeps its own place in its own files."""
        return {"stream_workers": self.module.num_workers}

    def check_resume(self, state: dict[str, Any]) -> None:
        """Refuse a checkpoint of a data mixture, or of another number of stream workers."""
        check_same_mixture(state, [])
        check_stream_workers(self.module, state)

    def packing_metrics(self) -> dict[str, float]:
        """The metrics of the stream's first buffer."""
        return first_rows_metrics(self.module, self.first_rows)


def check_streaming(module: "PackedTextDataModule", packing_buffer: int) -> None:
    """Refuse, in one line saying what to set instead, what streaming cannot do."""
    if packing_buffer < 1:
        raise ConfigError(f"data.packing_buffer must be a positive integer, got {packing_buffer}")
    if module.tokenizer_options.get("kind") == "bpe":
        raise ConfigError(
            "data.tokenizer.kind=bpe trains on the corpus, which streaming never holds: "
            "train it once in a run without data.streaming, then pass "
            "data.tokenizer.kind=pretrained data.tokenizer.path=<run dir>/tokenizer"
        )
    if module.bucket_by_length:
        raise ConfigError("data.bucket_by_length sorts the whole corpus: set it false")


def split_held_out(
    count: int, fractions: dict[str, float], split_seed: int
) -> dict[str, np.ndarray]:
    """`count` held-out documents split between validation and test in the fractions' ratio."""
    share = fractions["val"] / (fractions["val"] + fractions["test"])
    val = max(1, round(count * share))
    order = shuffled_documents(count, split_seed)
    return {"val": np.sort(order[:val]), "test": np.sort(order[val:])}


def rank_stream(module: "TextDataModule", paths: list[str], packing_buffer: int) -> StreamedRows:
    """This rank's endless stream of the training rows of `paths`."""
    trainer = module.trainer
    world_size, rank = (trainer.world_size, trainer.global_rank) if trainer else (1, 0)
    seed = torch.initial_seed() if module.shuffle_seed is None else module.shuffle_seed
    stream = StreamedRows(
        resolve_stream_files(paths),
        module.separator,
        module.text_field,
        module.encoder(),
        module.max_seq_len,
        module.overlong,
        module.packing,
        module.packing_strategy,
        packing_buffer,
        seed % 2**63,
        rank=rank,
        world_size=world_size,
        missing_text=module.missing_text,
    )
    stream.check_workers(module.num_workers)
    if world_size > 1 and stream.shards_per_rank == len(stream.files):
        log.warning(
            "%s has %d files, which %d ranks do not share evenly: every rank reads every file "
            "and keeps 1 document in %d",
            paths,
            len(stream.files),
            world_size,
            world_size,
        )
    return stream


def stream_loader(
    module: "PackedTextDataModule", stream: StreamedRows | MixedStream, batch_size: int
) -> StatefulDataLoader:
    """The training loader of `stream`, as long as the run (see `run_rows`)."""
    stream.run_rows = run_rows(module, batch_size)
    return StatefulDataLoader(
        stream,
        batch_size=batch_size,
        collate_fn=module.collate(),
        num_workers=module.num_workers,
        persistent_workers=module.num_workers > 0,
    )


def run_rows(module: "PackedTextDataModule", batch_size: int) -> int | None:
    """The rows the run reads, from its trainer's `max_steps` (None outside a Trainer).

    An endless stream needs the run to say when it ends.
    """
    trainer = module.trainer
    if trainer is None:
        return None
    if trainer.max_steps is None or trainer.max_steps < 0:
        raise ConfigError(
            "data.streaming=true streams endlessly: set trainer.max_steps to the run's "
            "length (and trainer.max_epochs=-1)"
        )
    return trainer.max_steps * trainer.accumulate_grad_batches * batch_size


def check_stream_workers(module: "PackedTextDataModule", state: dict[str, Any]) -> None:
    """Refuse another number of workers than the checkpoint's.

    The stream's position is kept per worker, and cannot be dealt out again exactly over
    another count.
    """
    saved = state.get("stream_workers")
    if saved is not None and saved != module.num_workers:
        raise ConfigError(
            f"This checkpoint streamed its training data with data.num_workers={saved}, "
            f"and this run asks for {module.num_workers}: the stream's position is "
            f"kept per worker, so it resumes exactly only with the same count. Resume with "
            f"data.num_workers={saved}."
        )


def first_rows_metrics(
    module: "PackedTextDataModule", rows: list[list[Sample]]
) -> dict[str, float]:
    """The packing metrics of a stream's first buffer of rows."""
    lengths = np.array([sum(map(len, row)) for row in rows], dtype=np.int64)
    return module.row_metrics(lengths, sum(map(len, rows)))
