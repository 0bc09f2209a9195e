"""Preference pairs for DPO and its kin (`data=preferences`, `model.objective=dpo`).

Rows come from JSONL, JSON or Parquet files, globs or folders (`paths`), in TRL's standard
formats (src/data/text/preference/records.py), or from the synthetic preference set when
`paths` is null. Each pair's prompt with either response is rendered by `data.template` as SFT
renders a conversation and tokenised once into the token store, as two documents whose targets
are the response; prompts are never supervised. Pairs are split into train/val/test by
`split_seed`. A sequence longer than `max_seq_len` has its prompt cut from the left
(`overlong=truncate`, counted in the data report), or its pair dropped or refused; responses are
never cut. Packed, each row of `2 * max_seq_len` slots holds whole pairs; padded, each batch is
`batch_size` pairs. Either way a pair's chosen and rejected sequences go through the model in
one forward (src/data/text/preference/rows.py).

With `precompute_ref_logps`, the model computes each pair's reference log-probabilities once
before training (`serve_reference_logps`); they are stored in the token store's folder
(src/data/text/preference/reference_logps.py) and served with every batch.
"""

import hashlib
import json
import logging
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, cast

import datasets
import numpy as np
import pyarrow as pa
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from src.data.corpus.readers import resolve_files
from src.data.corpus.token_store import TokenStore
from src.data.packing.packing import Rows, TokenAccounting, no_samples_left, pack
from src.data.sampler import resumable_loader
from src.data.text.chat_template import ChatTemplate
from src.data.text.conversations import (
    TurnTemplate,
    encode_pieces,
    read_record_files,
    synthetic_file,
)
from src.data.text.packed_text import PackedTextDataModule
from src.data.text.preference import reference_logps
from src.data.text.preference.records import pair_of, render_pairs
from src.data.text.preference.rows import PairRows, collate_pairs, fit_pairs, prompt_lengths
from src.data.text.preference.synthetic import make_pairs
from src.data.text.sources.stored import StoredSource
from src.utils.errors import ConfigError, DataError

log = logging.getLogger(__name__)


class PreferenceDataModule(PackedTextDataModule):
    """Preference pairs from files, or the synthetic set, as batches of pairs (module docstring).

    `paths` are files, globs or folders; null is the synthetic set (`synthetic_count` rows by
    `synthetic_seed`, written to the cache folder). `template` renders the turns as for SFT
    (conf/data/sft.yaml). The other options are `PackedTextDataModule`'s; `batch_size` counts
    rows when packing, pairs when not.
    """

    default_overlong = "truncate"
    has_targets = True

    def __init__(
        self,
        paths: list[str] | None = None,
        template: dict[str, str] | str | None = None,
        synthetic_count: int = 3000,
        synthetic_seed: int = 0,
        precompute_ref_logps: bool = False,
        **options,
    ):
        super().__init__(**options)
        if self.bucket_by_length:
            raise ConfigError(
                "data.bucket_by_length draws padded batches of similar documents; preference "
                "batches pad each pair's sequences together: set it to false"
            )
        self.template = TurnTemplate(template, self.tokenizer_options)
        self.paths = list(paths) if paths else None
        self.synthetic = (synthetic_count, synthetic_seed)
        self.precompute_ref_logps = precompute_ref_logps
        self.source = PairSource(self)
        # Columns that `datasets` keeps as JSON text, holding texts in some rows and message
        # lists in others (or messages of differing fields): the encoder decodes them.
        self.json_columns: tuple[str, ...] = ()

    # -- reading -----------------------------------------------------------------------------

    def source_files(self) -> list[Path]:
        if self.paths is not None:
            return resolve_files(self.paths, key="data.paths", hub=self.hub)
        count, seed = self.synthetic
        name = f"preferences-synthetic-{count}-{seed}.jsonl"
        return [synthetic_file(self.cache_dir, name, partial(make_pairs, count, seed))]

    def source_options(self) -> str:
        return self.template.key()

    def read_corpus(self, files: list[Path], work_dir: Path) -> datasets.Dataset:
        not_text = f"{self._where()}: preference pairs are JSONL, JSON or Parquet, not .txt"
        corpus = read_record_files(files, work_dir, not_text)
        if not {"chosen", "rejected"} <= set(corpus.column_names):
            raise DataError(
                f"{files[0]} needs the columns chosen and rejected (and prompt, unless the "
                f"responses begin with it); its columns are {corpus.column_names}"
            )
        if not len(corpus):
            raise DataError(f"{[str(p) for p in files]} hold no pairs")
        features = corpus.features
        self.json_columns = tuple(c for c in features if isinstance(features[c], datasets.Json))
        return corpus

    def training_texts(
        self, corpus: datasets.Dataset, rows: np.ndarray, part: int = 0
    ) -> Iterator[str]:
        renderer = self.template.renderer()
        for start in range(0, len(rows), 1000):
            chunk = rows[start : start + 1000].tolist()
            for pieces in rendered_pairs(
                corpus.select(chunk).to_list(), chunk, renderer, self._where()
            ):
                yield "".join(text for text, _ in pieces if text is not None)

    def encoder(self, part: int = 0) -> Callable[[pa.Table, list[int]], pa.Table]:
        self.template.check_end_of_turn(self.tokenizer)
        return partial(
            encode_pairs,
            tokenizer=self.tokenizer,
            template=self.template.renderer(),
            where=self._where(),
            json_columns=self.json_columns,
        )

    def _where(self) -> str:
        return "the synthetic preference set" if self.paths is None else f"data.paths={self.paths}"

    def describe_pair(self, pair: int) -> str:
        """How errors name a pair: its row."""
        return f"{self._where()}, row {pair + 1}"

    # -- pairs -------------------------------------------------------------------------------

    def store_splits(  # type: ignore[override]  # rows of pairs, served as the base's rows are
        self, store: TokenStore, splits: dict[str, np.ndarray]
    ) -> tuple[dict[str, PairRows], dict[str, TokenAccounting]]:
        """The rows of each split's pairs (`splits` hold pair indices), and the token accounting."""
        lengths, prompts = store.lengths(), prompt_lengths(store)
        rows, accounting = {}, {}
        for split, pairs in splits.items():
            kept, pieces, accounting[split] = fit_pairs(
                pairs, lengths, prompts, self.max_seq_len, self.overlong, self.describe_pair
            )
            if split != "test" and not len(kept):
                documents = np.stack((2 * pairs, 2 * pairs + 1), 1).reshape(-1)
                raise DataError(no_samples_left(split, lengths[documents], self.max_seq_len, True))
            pair_lengths = pieces.length.reshape(-1, 2).sum(1)
            grouped = (
                pack(pair_lengths, 2 * self.max_seq_len, self.packing_strategy)
                if self.packing
                else Rows.one_per_row(len(kept))
            )
            rows[split] = PairRows(store, kept, pieces, grouped)
        return rows, accounting

    def split_loader(self, rows, batch_size: int, shuffle: bool) -> StatefulDataLoader:
        """The resumable loader of a split's pairs (shuffled for training)."""
        unit = "rows" if self.packing else "pairs"
        return resumable_loader(self, rows, batch_size, shuffle, unit, collate_fn=self.collate())

    def collate(self) -> Callable[[list], dict[str, torch.Tensor]]:
        """`collate_pairs` for this module's rows: packed rows of 2 * `max_seq_len`, or padded."""
        assert self.tokenizer is not None  # loaders are built after setup
        return partial(
            collate_pairs,
            pad_id=self.tokenizer.pad_token_id,
            row_length=2 * self.max_seq_len if self.packing else None,
            pad_to_multiple_of=self.pad_to_multiple_of,
        )

    def packing_metrics(self) -> dict[str, float]:
        """Rows, padding fraction and sequences per row of the training batches."""
        train = self.datasets["train"]
        if self.packing:
            lengths = train.row_lengths()
            slots = len(lengths) * 2 * self.max_seq_len
        else:  # 2 * batch_size rows a batch, each as long as its longest sequence
            lengths = train.pieces.length
            starts = np.arange(0, len(train), self.batch_size)
            sequences = train.pieces.length.reshape(-1, 2)
            longest = np.maximum.reduceat(sequences.max(1), starts) if len(starts) else starts
            sizes = np.diff(np.append(starts, len(train)))
            slots = int((longest * 2 * sizes).sum())
        rows = len(lengths) if self.packing else 2 * len(train)
        return {
            "data/rows": rows,
            "data/padding_fraction": 1 - int(lengths.sum()) / max(1, slots),
            "data/documents_per_row": len(train.pieces) / max(1, rows),
        }

    # -- reference log-probabilities -----------------------------------------------------------

    def serve_reference_logps(
        self,
        weights_key: str,
        compute: Callable[[dict[str, torch.Tensor]], torch.Tensor] | None,
    ) -> None:
        """Serve each pair's reference log-probabilities with it: found stored, or computed.

        `weights_key` names the reference's weights; `compute` maps a batch to its [P, 2]
        log-probabilities, for the pairs of every split in order, when they are not stored
        (None: they must be).
        """
        if not self.precompute_ref_logps:
            raise ConfigError(
                "model.preference.precomputed_reference=true takes the reference "
                "log-probabilities from the data: set data.precompute_ref_logps=true"
            )
        store = self.store()
        if not self.datasets:
            self.setup()
        identity = f"{store.manifest['key']}|{weights_key}|{self.max_seq_len}|{self.overlong}"
        key = hashlib.sha256(identity.encode()).hexdigest()[:20]
        count = store.num_documents // 2
        values = reference_logps.load(store.folder, key, count)
        splits = cast(dict[str, PairRows], self.datasets)  # as store_splits built them
        if values is None:
            if compute is None:
                raise DataError(
                    f"The reference log-probabilities this run trained with are not in "
                    f"{store.folder}: evaluate with the data.cache_dir it trained with"
                )
            values = np.full((count, 2), np.nan, dtype=np.float32)
            for rows in splits.values():
                for pairs, batch in self._batches_in_order(rows):
                    values[pairs] = compute(batch).numpy()
            reference_logps.save(store.folder, key, values)
            log.info("Computed the reference log-probabilities of %d pairs", count)
        for rows in splits.values():
            rows.reference = values

    def _batches_in_order(self, rows: PairRows) -> Iterator[tuple[np.ndarray, dict]]:
        """(store pair indices, batch) of every row of `rows`, `eval_batch_size` rows a batch."""
        collate = self.collate()
        for start in range(0, len(rows), self.eval_batch_size):
            numbers = range(start, min(start + self.eval_batch_size, len(rows)))
            pairs = rows.pairs[np.concatenate([rows.rows[i] for i in numbers])]
            yield pairs, collate([rows[i] for i in numbers])


class PairSource(StoredSource):
    """The stored source of preference pairs: its splits are drawn over pairs, not documents."""

    def setup(self, store: TokenStore) -> None:
        splits = self.split_documents([store.num_documents // 2])
        self.datasets, self.accounting = self.module.store_splits(store, splits)


def rendered_pairs(
    records: list[dict[str, Any]],
    indices: list[int],
    template: dict[str, str] | ChatTemplate,
    where: str,
):
    """Each record's chosen and rejected conversation as (text, is target) pieces."""
    wheres = [f"{where}, row {index + 1}" for index in indices]
    pairs = [pair_of(record, row) for record, row in zip(records, wheres, strict=True)]
    return render_pairs(pairs, wheres, template)


def encode_pairs(
    table: pa.Table,
    indices: list[int],
    tokenizer,
    template: dict[str, str] | ChatTemplate,
    where: str,
    json_columns: tuple[str, ...] = (),
) -> pa.Table:
    """`Dataset.map`'s function: two documents a row, chosen then rejected, targets on the response.

    The values of `json_columns` are read back from their JSON text first.
    """
    records = table.to_pylist()
    for record in records:
        for column in json_columns:
            record[column] = from_json_column(record[column])
    return encode_pieces(rendered_pairs(records, indices, template, where), tokenizer)


def from_json_column(value: str | None) -> Any:
    """A value of a column `datasets` keeps as JSON text: a text, or a list of messages.

    `datasets` stores a text that is valid JSON as it is (`"0"`), any other as JSON (`'"x"'`).
    """
    if value is None:
        return None
    decoded = json.loads(value)
    return decoded if isinstance(decoded, str | list) else value
