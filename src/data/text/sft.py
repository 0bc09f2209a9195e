"""Supervised fine-tuning on conversations: the loss covers the responses only.

A JSONL line (or Parquet row) is `{"prompt": ..., "response": ...}` or `{"messages": [{"role":
..., "content": ...}, ...]}` with roles system, user and assistant. Each turn is rendered with
a template; every assistant turn's content and the end-of-turn token after it are targets,
nothing else is (not the system or user turns, not the template's text).

The template is either format strings (`render` in `src.data.text.conversations`) or, with
`template="tokenizer"`, the chat template of the tokenizer folder (`src.data.text.chat_template`).
"""

import logging
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa

from src.data.text.chat_template import ChatTemplate
from src.data.text.conversations import (
    Pieces,
    TurnTemplate,
    checked_turns,
    encode_pieces,
    read_record_files,
    render_conversations,
    synthetic_file,
)
from src.data.text.packed_text import PackedTextDataModule
from src.data.text.sources.mixed import MixedSource
from src.data.text.sources.mixture import parse_mixture
from src.data.text.synthetic_sft import make_examples
from src.utils.errors import ConfigError, DataError

log = logging.getLogger(__name__)


class SFTDataModule(PackedTextDataModule):
    """Conversations from JSONL or Parquet files, or the synthetic instruction set.

    `path` is a file, a glob or a folder; when it is null, the conversations are the synthetic
    instruction set of `src.data.text.synthetic_sft` (`synthetic_count` examples by
    `synthetic_seed`, written to the cache folder so it can be read).

    `template` renders each turn: `system` and `user` are format strings of `{content}`;
    `assistant` is the text before an answer. `template="tokenizer"` renders with the chat
    template of the pretrained tokenizer folder instead (`src.data.text.chat_template`). Over-long
    conversations are dropped by default; `overlong=split` would train on conversations cut in
    two and needs `allow_split=true`.
    `exact_match_samples` validation prompts are answered greedily at each validation to
    report exact-match accuracy.
    """

    default_overlong = "drop"
    has_targets = True

    def __init__(
        self,
        path: str | None = None,
        template: dict[str, str] | str | None = None,
        synthetic_count: int = 4000,
        synthetic_seed: int = 0,
        allow_split: bool = False,
        exact_match_samples: int = 64,
        mixture: list[dict[str, Any]] | None = None,
        **options,
    ):
        super().__init__(**options)
        if mixture is not None:
            if path is not None:
                raise ConfigError(
                    f"data.path={path!r} and data.mixture both name the conversations: set "
                    f"data.path=null and list every file in the mixture's sources"
                )
            self.source = MixedSource(self, parse_mixture(mixture))
        if self.overlong == "split" and not allow_split:
            raise ConfigError(
                "data.overlong=split would cut conversations in two, so that answers lose their "
                "prompts; choose truncate, drop or raise, or set data.allow_split=true"
            )
        self.template = TurnTemplate(template, self.tokenizer_options)
        self.path = path
        self.synthetic = (synthetic_count, synthetic_seed)
        self.exact_match_samples = exact_match_samples

    # -- reading -----------------------------------------------------------------------------

    def source_files(self) -> list[Path]:
        if self.path is not None:
            return self.resolve([self.path], "data.path")
        count, seed = self.synthetic
        name = f"sft-synthetic-{count}-{seed}.jsonl"
        return [synthetic_file(self.cache_dir, name, partial(make_examples, count, seed))]

    def source_options(self) -> str:
        return self.template.key()

    def read_corpus(self, files: list[Path], work_dir: Path) -> datasets.Dataset:
        not_text = f"{[str(p) for p in files]}: conversations are JSONL or Parquet, not .txt"
        corpus = read_record_files(files, work_dir, not_text)
        if (
            not {"prompt", "response"} <= set(corpus.column_names)
            and "messages" not in corpus.column_names
        ):
            raise DataError(
                f"{files[0]} needs the columns prompt and response, or messages; its columns "
                f"are {corpus.column_names}"
            )
        if not len(corpus):
            raise DataError(f"{[str(p) for p in files]} hold no examples")
        return corpus

    def training_texts(
        self, corpus: datasets.Dataset, rows: np.ndarray, part: int = 0
    ) -> Iterator[str]:
        where, renderer = self._where(part), self.template.renderer()
        for start in range(0, len(rows), 1000):
            chunk = rows[start : start + 1000]
            records = corpus.select(chunk).to_list()
            for pieces in render_rows(records, chunk.tolist(), renderer, where):
                yield "".join(text for text, _ in pieces if text is not None)

    def encoder(self, part: int = 0) -> Callable[[pa.Table, list[int]], pa.Table]:
        self.template.check_end_of_turn(self.tokenizer)
        return partial(
            encode_conversations,
            tokenizer=self.tokenizer,
            template=self.template.renderer(),
            where=self._where(part),
        )

    def _where(self, part: int) -> str:
        """How errors name the conversations of store part `part`."""
        if self.source_names:
            return f"data.mixture[{part}] ({self.source_names[part]})"
        return "the synthetic set" if self.path is None else f"data.path={self.path}"

    # -- exact match -------------------------------------------------------------------------

    def exact_match_examples(self, split: str = "val") -> list[tuple[list[int], str]]:
        """Up to `exact_match_samples` (prompt ids, expected answer) pairs from `split`.

        Each is the conversation up to its last answer, and that answer (its last run of
        targets, without the end-of-turn token, and what the template writes after it).
        """
        store = self.store()
        assert store.targets is not None  # SFT stores keep a target mask (has_targets)
        assert self.tokenizer is not None  # store() sets it
        examples = []
        for document in self.source.split_documents(store.part_documents)[split]:
            begin, end = store.offsets[document], store.offsets[document + 1]
            tokens, targets = store.tokens[begin:end], store.targets[begin:end] != 0
            answer_start = np.flatnonzero(targets & ~np.concatenate(([False], targets[:-1])))[-1]
            answer_end = np.flatnonzero(targets)[-1]  # the end-of-turn token
            if answer_start < self.max_seq_len:
                answer = self.tokenizer.decode(tokens[answer_start:answer_end].tolist())
                examples.append((tokens[:answer_start].tolist(), answer))
            if len(examples) == self.exact_match_samples:
                break
        return examples


def conversation_of(record: dict[str, Any], where: str, index: int) -> list[dict[str, str]]:
    """One record as a list of turns ending with an assistant turn.

    Otherwise a DataError names the row and what is wrong with it.
    """
    where = f"{where}, row {index + 1}"
    if record.get("prompt") is not None and record.get("response") is not None:
        turns = [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["response"]},
        ]
    elif isinstance(record.get("messages"), list):
        turns = record["messages"]
    else:
        shown = {k: v for k, v in record.items() if v is not None}
        raise DataError(
            f'{where} needs {{"prompt": ..., "response": ...}} or {{"messages": [...]}}, got '
            f"{str(shown)[:80]!r}"
        )
    turns = checked_turns(turns, where)
    if not turns or turns[-1]["role"] != "assistant":
        raise DataError(f"{where}: the conversation must end with an assistant message")
    return turns


def render_rows(
    records: list[dict[str, Any]],
    indices: list[int],
    template: dict[str, str] | ChatTemplate,
    where: str,
) -> Sequence[Pieces]:
    """The (text, is target) pieces of each record, by format strings or by a chat template.

    A chat template renders all the batch's conversations together.
    """
    conversations = [
        conversation_of(record, where, index)
        for record, index in zip(records, indices, strict=True)
    ]
    wheres = [f"{where}, row {index + 1}" for index in indices]
    return render_conversations(conversations, wheres, template)


def encode_conversations(
    table: pa.Table,
    indices: list[int],
    tokenizer,
    template: dict[str, str] | ChatTemplate,
    where: str,
) -> pa.Table:
    """`Dataset.map`'s function: each conversation's token ids and target mask."""
    return encode_pieces(render_rows(table.to_pylist(), indices, template, where), tokenizer)
