"""The token source of a weighted data mixture (`data.mixture`), drawn as `mixture` says.

The sources are the parts of one token store, source after source (its manifest counts each
one's documents), so that one tokenizer covers them and errors name any document. Each source's
documents are split into train, val and test by the fractions within that source; when
streaming, the store holds each source's held-out `val_paths` instead, split between val and
test, and the training rows come from one stream per source. Validation and test serve a loader
per source, so that each source's loss is logged apart (`val/sources/<name>/loss`) while the
pooled metrics (`val/loss`) cover them all.
"""

from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from torchdata.stateful_dataloader import StatefulDataLoader

from src.data.corpus.rows import PackedRows, concatenated
from src.data.corpus.token_store import TokenStore
from src.data.packing.packing import Sample, TokenAccounting
from src.data.sampler import resumable_loader
from src.data.text.sources.mixture import (
    MixedStream,
    MixtureSampler,
    WeightedSource,
    check_same_mixture,
    rows_per_epoch,
)
from src.data.text.sources.stored import split_by_fractions
from src.data.text.sources.streamed import (
    check_stream_workers,
    check_streaming,
    first_rows_metrics,
    rank_stream,
    split_held_out,
    stream_loader,
)
from src.utils.errors import ConfigError

if TYPE_CHECKING:  # the datamodule builds its source: imported for the types only
    from src.data.text.packed_text import PackedTextDataModule
    from src.data.text.pretraining import TextDataModule


class MixedSource:
    """The `TokenSource` of `data.mixture`: see the module docstring.

    Stored, the training rows of all sources are one dataset that `MixtureSampler` draws from
    by weight; streamed (`packing_buffer` set), a `MixedStream` of one stream per source.
    """

    def __init__(
        self,
        module: "PackedTextDataModule",
        sources: list[WeightedSource],
        packing_buffer: int | None = None,
    ):
        if module.bucket_by_length:
            raise ConfigError(
                "data.bucket_by_length forms batches before a data mixture draws its rows by "
                "weight: set it false (or data.packing=true, which pads less)"
            )
        self.streaming = packing_buffer is not None
        if packing_buffer is not None:
            check_streaming(module, packing_buffer)
        self.module = module
        self.sources = sources
        self.packing_buffer = packing_buffer
        self.names = tuple(source.name for source in sources)
        self.datasets: dict[str, PackedRows] = {}  # every source's rows together, per split
        self.accounting: dict[str, TokenAccounting] = {}
        self.parts: list[dict[str, PackedRows]] = []  # each source's rows, per split
        self.part_accounting: list[dict[str, TokenAccounting]] = []
        self.first_rows: list[list[list[Sample]]] = []  # streaming: each stream's first buffer
        self.stream: MixedStream | None = None

    @property
    def weights(self) -> list[float]:
        return [source.weight for source in self.sources]

    def store_parts(self) -> list[list[Path]]:
        key = "val_paths" if self.streaming else "paths"
        return [
            self.module.resolve(getattr(source, key), f"data.mixture[{index}].{key}")
            for index, source in enumerate(self.sources)
        ]

    def part_splits(self, counts: Sequence[int]) -> list[dict[str, np.ndarray]]:
        """Each source's split documents, as indices of the store."""
        fractions, seed = self.module.fractions, self.module.split_seed
        parts = []
        for name, count, start in zip(
            self.names, counts, np.cumsum([0, *counts[:-1]]), strict=True
        ):
            if self.streaming:
                splits = split_held_out(count, fractions, seed)
            else:
                splits = split_by_fractions(count, fractions, seed, f" of the source {name}")
            parts.append({split: start + documents for split, documents in splits.items()})
        return parts

    def split_documents(self, counts: Sequence[int]) -> dict[str, np.ndarray]:
        """Each split's documents, the sources taking turns, each source's in its own order.

        So the first few of a split (SFT's exact-match prompts) come from every source.
        """
        parts = self.part_splits(counts)
        return {split: taking_turns([part[split] for part in parts]) for split in parts[0]}

    def setup(self, store: TokenStore) -> None:
        built = [self.module.store_splits(store, s) for s in self.part_splits(store.part_documents)]
        self.parts = [rows for rows, _ in built]
        self.part_accounting = [accounting for _, accounting in built]
        if self.streaming:
            self._set_up_streams()
        self.datasets = {
            split: concatenated([rows[split] for rows in self.parts]) for split in self.parts[0]
        }
        self.accounting = {
            split: TokenAccounting.total([accounting[split] for accounting in self.part_accounting])
            for split in self.part_accounting[0]
        }

    def _set_up_streams(self) -> None:
        assert self.packing_buffer is not None  # streaming
        module = cast("TextDataModule", self.module)  # only data=text streams
        streams = [rank_stream(module, s.paths, self.packing_buffer) for s in self.sources]
        self.first_rows = []
        for stream, accounting in zip(streams, self.part_accounting, strict=True):
            rows, _, accounting["train"] = stream.first_buffer()
            self.first_rows.append(rows)
        self.stream = MixedStream(streams, self.weights)

    def loader(
        self, split: str, batch_size: int, shuffle: bool
    ) -> StatefulDataLoader | list[StatefulDataLoader]:
        """Training: the rows drawn by weight. Validation and test: a loader per source."""
        if split != "train":
            return [self.module.split_loader(p[split], batch_size, shuffle) for p in self.parts]
        if self.stream is not None:
            return stream_loader(self.module, self.stream, batch_size)
        module = self.module
        sizes = [len(rows["train"]) for rows in self.parts]
        kind = partial(MixtureSampler, sizes=sizes, weights=self.weights)
        unit = "rows" if module.packing else "documents"
        rows = self.datasets["train"]
        return resumable_loader(
            module, rows, batch_size, shuffle, unit, kind, collate_fn=module.collate()
        )

    def packing_metrics(self) -> dict[str, float]:
        """The training rows' metrics, pooled and per source, with each source's share.

        Per source (`data/sources/<name>/...`): its token accounting, its weight, its training
        rows and, stored, how many of an epoch's rows it gives (`rows_per_epoch`), how often
        that shows each of its rows (`repeats_per_epoch`), and its expected share of the
        epoch's tokens (`token_share`). Streamed, its first buffer stands for it.
        """
        if self.streaming:
            rows = [row for buffer in self.first_rows for row in buffer]
            metrics = first_rows_metrics(self.module, rows)
            sizes = [len(buffer) for buffer in self.first_rows]
            tokens = [sum(len(s) for row in buffer for s in row) for buffer in self.first_rows]
            drawn = np.asarray(self.weights, dtype=np.float64)  # shares of the rows, not counts
        else:
            train = self.datasets["train"]
            metrics = self.module.row_metrics(train.row_lengths(), len(train.pieces))
            sizes = [len(rows["train"]) for rows in self.parts]
            tokens = [int(rows["train"].row_lengths().sum()) for rows in self.parts]
            drawn = rows_per_epoch(self.weights, sum(sizes))
        per_row = np.asarray(tokens, dtype=np.float64) / np.maximum(sizes, 1)
        shares = drawn * per_row / max(float((drawn * per_row).sum()), 1e-12)
        for index, name in enumerate(self.names):
            prefix = f"data/sources/{name}"
            metrics |= self.part_accounting[index]["train"].as_metrics(prefix)
            metrics |= {
                f"{prefix}/weight": self.weights[index],
                f"{prefix}/rows": sizes[index],
                f"{prefix}/token_share": float(shares[index]),
            }
            if not self.streaming:
                metrics[f"{prefix}/rows_per_epoch"] = int(drawn[index])
                metrics[f"{prefix}/repeats_per_epoch"] = float(drawn[index] / max(sizes[index], 1))
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """The sources and their weights, and when streaming the loader workers' count."""
        state: dict[str, Any] = {"mixture": [[s.name, s.weight] for s in self.sources]}
        if self.streaming:
            state["stream_workers"] = self.module.num_workers
        return state

    def check_resume(self, state: dict[str, Any]) -> None:
        """Refuse a checkpoint of another mixture, or of another number of stream workers."""
        check_same_mixture(state, self.sources)
        if self.streaming:
            check_stream_workers(self.module, state)


def taking_turns(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The arrays' items interleaved, first items first: [a0, b0, a1, b1, a2, ...]."""
    turn = np.concatenate([np.arange(len(array)) for array in arrays])
    return np.concatenate(arrays)[np.argsort(turn, kind="stable")]
