"""Prompts to sample completions for (`data=prompts`), with the columns their rewards read.

Rows come from JSONL, JSON or Parquet files, globs or folders (`paths`) in TRL's prompt formats
(src/data/text/prompts/records.py), or from the synthetic sums when `paths` is null. Each
prompt is rendered by `data.template` as SFT renders a conversation up to its answer, and
tokenised once, in memory: a prompt set is small next to what is generated from it. A prompt
longer than `max_prompt_length` tokens is cut from the left (`overlong=truncate`, counted in the
log), dropped, or refused naming its row. Rows are split into train/val/test by `split_seed`.

A batch holds `batch_size` prompts: `input_ids` [B, T] padded on the right, `prompt_lengths`
[B], and as plain lists `prompts` (each row's prompt as given) and `columns` (every other
column by name), which the reward functions receive.
"""

import logging
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from src.data.corpus.hub import HubOptions
from src.data.corpus.readers import resolve_files
from src.data.corpus.tokenizers import build_tokenizer
from src.data.sampler import SplitLoaders, resumable_loader
from src.data.splits import check_fractions, check_loader_options
from src.data.text.conversations import TurnTemplate, read_record_files, synthetic_file
from src.data.text.prompts.records import prompt_messages, render_prompts
from src.data.text.prompts.synthetic import make_sums
from src.utils.contracts import TOKENS
from src.utils.errors import ConfigError, DataError

log = logging.getLogger(__name__)

OVERLONG = ("truncate", "drop", "raise")


class PromptSet(Dataset):
    """Tokenised prompts with their rows' values; item i is the row's index."""

    def __init__(self, token_ids: list[np.ndarray], prompts: list[Any], columns: dict[str, list]):
        self.token_ids = token_ids
        self.prompts = prompts
        self.columns = columns

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, index: int) -> int:
        return index

    def subset(self, indices: np.ndarray) -> "PromptSet":
        pick = indices.tolist()
        columns = {name: [values[i] for i in pick] for name, values in self.columns.items()}
        return PromptSet(
            [self.token_ids[i] for i in pick], [self.prompts[i] for i in pick], columns
        )

    def collate(self, indices: Sequence[int], pad_id: int) -> dict[str, Any]:
        """The batch of rows `indices` (module docstring)."""
        lengths = torch.tensor([len(self.token_ids[i]) for i in indices])
        input_ids = torch.full((len(indices), int(lengths.max())), pad_id, dtype=torch.long)
        for row, index in enumerate(indices):
            input_ids[row, : lengths[row]] = torch.from_numpy(
                self.token_ids[index].astype(np.int64)
            )
        return {
            "input_ids": input_ids,
            "prompt_lengths": lengths,
            "prompts": [self.prompts[i] for i in indices],
            "columns": {
                name: [values[i] for i in indices] for name, values in self.columns.items()
            },
        }


class PromptDataModule(SplitLoaders, LightningDataModule):
    """Prompt batches for `model.objective=grpo` (module docstring).

    `paths` are files, globs or folders; null is the synthetic sums (`synthetic_count` rows by
    `synthetic_seed`, written to `cache_dir`); `hf://datasets/<org>/<name>` is that dataset's
    split `hf_split` (config `hf_config`, revision `hf_revision`; `src.data.corpus.hub`).
    `template` and `tokenizer` are SFT's (conf/data/sft.yaml).
    """

    batch_kind = TOKENS

    def __init__(
        self,
        paths: list[str] | None = None,
        template: dict[str, str] | str | None = None,
        tokenizer: dict[str, Any] | None = None,
        synthetic_count: int = 4000,
        synthetic_seed: int = 0,
        max_prompt_length: int = 256,
        overlong: str = "truncate",
        batch_size: int = 16,
        eval_batch_size: int | None = None,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        split_seed: int = 1234,
        shuffle_seed: int | None = None,
        num_workers: int = 0,
        cache_dir: str | None = None,
        hf_split: str = "train",
        hf_config: str | None = None,
        hf_revision: str | None = None,
    ):
        super().__init__()
        if overlong not in OVERLONG:
            raise ConfigError(f"data.overlong={overlong!r}: choose one of {', '.join(OVERLONG)}")
        if max_prompt_length < 1:
            raise ConfigError(f"data.max_prompt_length must be positive, got {max_prompt_length}")
        check_loader_options(batch_size, eval_batch_size)
        check_fractions(val_fraction, test_fraction)
        self.paths = list(paths) if paths else None
        self.tokenizer_options = dict(tokenizer or {})
        self.template = TurnTemplate(template, self.tokenizer_options)
        self.synthetic = (synthetic_count, synthetic_seed)
        self.max_prompt_length = max_prompt_length
        self.overlong = overlong
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.fractions = {"val": val_fraction, "test": test_fraction}
        self.split_seed = split_seed
        self.shuffle_seed = shuffle_seed
        self.num_workers = num_workers
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.hub = HubOptions(hf_split, hf_config, hf_revision, self.cache_dir)
        self.tokenizer: Any = None
        self.splits: dict[str, PromptSet] = {}

    @property
    def vocab_size(self) -> int:
        self.setup()
        return self.tokenizer.vocab_size

    def setup(self, stage: str | None = None) -> None:
        """Read, render, tokenise and split the prompts, once."""
        if self.splits:
            return
        files = self._files()
        with TemporaryDirectory() as work_dir:
            not_text = f"data.paths={self.paths}: prompts are JSONL, JSON or Parquet, not .txt"
            rows = read_record_files(files, Path(work_dir), not_text).to_list()
        if not rows:
            raise DataError(f"{[str(p) for p in files]} hold no prompts")
        where = "the synthetic sums" if self.paths is None else f"data.paths={self.paths}"
        wheres = [f"{where}, row {index + 1}" for index in range(len(rows))]
        messages = [prompt_messages(row, at) for row, at in zip(rows, wheres, strict=True)]
        texts = render_prompts(messages, wheres, self.template.renderer())
        self.tokenizer = build_tokenizer(
            **self.tokenizer_options,
            training_texts=lambda: iter(texts),
            cache_dir=self.cache_dir,
            cache_key=where,
        )
        self.template.check_end_of_turn(self.tokenizer)
        values, lengths = self.tokenizer.encode_batch(texts)
        token_ids = np.split(np.asarray(values), np.cumsum(lengths)[:-1])
        keep = self._fit(token_ids, wheres)
        columns = {name: [row.get(name) for row in rows] for name in rows[0] if name != "prompt"}
        prompts = PromptSet(token_ids, [row["prompt"] for row in rows], columns)
        self.splits = self._split(prompts.subset(keep))

    def _files(self) -> list[Path]:
        if self.paths is not None:
            return resolve_files(self.paths, hub=self.hub)
        count, seed = self.synthetic
        rows = partial(make_sums, count, seed)
        return [synthetic_file(self.cache_dir, f"sums-{count}-{seed}.jsonl", rows)]

    def _fit(self, token_ids: list[np.ndarray], wheres: list[str]) -> np.ndarray:
        """The rows kept; over-long prompts cut from the left (in place), dropped or refused."""
        limit = self.max_prompt_length
        overlong = [i for i, ids in enumerate(token_ids) if len(ids) > limit]
        if overlong and self.overlong == "raise":
            first = overlong[0]
            raise DataError(
                f"{wheres[first]}: the prompt has {len(token_ids[first])} tokens, more than "
                f"data.max_prompt_length={limit}: raise it, or set data.overlong=truncate "
                f"(cut from the left) or drop"
            )
        if overlong:
            log.warning(
                "%d of %d prompts are longer than data.max_prompt_length=%d tokens: %s",
                len(overlong),
                len(token_ids),
                limit,
                "cut from the left" if self.overlong == "truncate" else "dropped",
            )
        if self.overlong == "truncate":
            for i in overlong:
                token_ids[i] = token_ids[i][-limit:]
            return np.arange(len(token_ids))
        return np.setdiff1d(np.arange(len(token_ids)), overlong)

    def _split(self, prompts: PromptSet) -> dict[str, PromptSet]:
        """train/val/test at random by `split_seed`, the same whatever the training seed."""
        order = np.random.default_rng(self.split_seed).permutation(len(prompts))
        counts = {name: round(share * len(prompts)) for name, share in self.fractions.items()}
        if counts["val"] == 0:
            raise DataError(
                f"{len(prompts)} prompts leave none for validation at data.val_fraction="
                f"{self.fractions['val']}: raise it, or give more prompts"
            )
        val, test = counts["val"], counts["val"] + counts["test"]
        return {
            "val": prompts.subset(order[:val]),
            "test": prompts.subset(order[val:test]),
            "train": prompts.subset(order[test:]),
        }

    def _loader(self, split: str, batch_size: int, shuffle: bool) -> StatefulDataLoader:
        self.setup()
        prompts = self.splits[split]
        collate = partial(prompts.collate, pad_id=self.tokenizer.pad_token_id)
        return resumable_loader(
            self, prompts, batch_size, shuffle, unit="prompts", collate_fn=collate
        )
