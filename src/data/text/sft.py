"""Supervised fine-tuning on conversations: the loss covers the responses only.

A JSONL line (or Parquet row) is `{"prompt": ..., "response": ...}` or `{"messages": [{"role":
..., "content": ...}, ...]}` with roles system, user and assistant. Each turn is rendered with
a template; every assistant turn's content and the end-of-turn token after it are targets,
nothing else is (not the system or user turns, not the template's text).

The template is either format strings (`render`, below) or, with `template="tokenizer"`, the
chat template of the tokenizer folder (`src.data.text.chat_template`).
"""

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa

from src.data.corpus.encoding import list_column
from src.data.corpus.readers import FORMATS, read_records, resolve_files
from src.data.corpus.token_store import token_dtype
from src.data.text.chat_template import ChatTemplate
from src.data.text.packed_text import PackedTextDataModule
from src.data.text.synthetic_sft import make_examples, write_jsonl
from src.utils.errors import ConfigError, DataError

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
# Compact enough for a byte-level tokenizer. For a Qwen tokenizer use its own chat template
# (template="tokenizer"), or its ChatML as format strings:
# user: "<|im_start|>user\n{content}<|im_end|>\n", assistant: "<|im_start|>assistant\n"
DEFAULT_TEMPLATE = {"system": "{content}\n", "user": "User: {content}\n", "assistant": "Bot: "}
TOKENIZER_TEMPLATE = "tokenizer"  # data.template=tokenizer: the tokenizer folder's chat template


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
        **options,
    ):
        super().__init__(**options)
        if self.overlong == "split" and not allow_split:
            raise ConfigError(
                "data.overlong=split would cut conversations in two, so that answers lose their "
                "prompts; choose truncate, drop or raise, or set data.allow_split=true"
            )
        self.chat_template: ChatTemplate | None = None
        self.template: dict[str, str] | str  # format strings, or TOKENIZER_TEMPLATE
        if isinstance(template, str):
            self._check_tokenizer_template(template)
            self.template = template
        else:
            self.template = {**DEFAULT_TEMPLATE, **(template or {})}
        self.path = path
        self.synthetic = (synthetic_count, synthetic_seed)
        self.exact_match_samples = exact_match_samples

    def _check_tokenizer_template(self, template: str) -> None:
        if template != TOKENIZER_TEMPLATE:
            raise ConfigError(
                f"data.template={template!r}: give format strings for system, user and "
                f"assistant (conf/data/sft.yaml), or {TOKENIZER_TEMPLATE!r} for the tokenizer "
                f"folder's own chat template"
            )
        kind = self.tokenizer_options.get("kind", "auto")
        path = self.tokenizer_options.get("path")
        if kind not in ("auto", "pretrained") or not path:
            raise ConfigError(
                f"data.template=tokenizer renders conversations with a tokenizer folder's chat "
                f"template, but data.tokenizer is kind={kind!r}, path={path!r}: set "
                f"data.tokenizer.kind=pretrained data.tokenizer.path=<a folder with "
                f"tokenizer.json and a chat template, e.g. Qwen3-0.6B>"
            )

    def template_renderer(self) -> dict[str, str] | ChatTemplate:
        """The format strings, or the tokenizer folder's chat template (read once)."""
        if isinstance(self.template, dict):  # a str is TOKENIZER_TEMPLATE (checked at init)
            return self.template
        if self.chat_template is None:
            self.chat_template = ChatTemplate(self.tokenizer_options["path"])
        return self.chat_template

    # -- reading -----------------------------------------------------------------------------

    def source_files(self) -> list[Path]:
        if self.path is not None:
            return resolve_files([self.path], key="data.path")
        count, seed = self.synthetic
        folder = self.cache_dir or Path("data/cache")
        path = folder / f"sft-synthetic-{count}-{seed}.jsonl"
        if not path.is_file():
            write_jsonl(make_examples(count, seed), path)
            log.info("Wrote %d synthetic instruction examples to %s", count, path)
        return [path]

    def source_options(self) -> str:
        renderer = self.template_renderer()
        if isinstance(renderer, ChatTemplate):
            return f"chat_template|{renderer.key}"
        return str(sorted(renderer.items()))

    def read_corpus(self, files: list[Path], work_dir: Path) -> datasets.Dataset:
        kinds = {FORMATS[path.suffix] for path in files}
        if "text" in kinds:
            raise DataError(
                f"data.path={self.path!r}: conversations are JSONL or Parquet, not .txt"
            )
        parts = [
            read_records([p for p in files if FORMATS[p.suffix] == k], k, work_dir)
            for k in sorted(kinds)
        ]
        corpus = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
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

    def training_texts(self, corpus: datasets.Dataset, rows: np.ndarray) -> Iterator[str]:
        where, renderer = self._where(), self.template_renderer()
        for start in range(0, len(rows), 1000):
            chunk = rows[start : start + 1000]
            records = corpus.select(chunk).to_list()
            for pieces in render_rows(records, chunk.tolist(), renderer, where):
                yield "".join(text for text, _ in pieces if text is not None)

    def encoder(self) -> Callable[[pa.Table, list[int]], pa.Table]:
        renderer = self.template_renderer()
        if isinstance(renderer, ChatTemplate):
            end = renderer.end_of_turn_token()
            eos_token = getattr(self.tokenizer, "eos_token", end)  # the byte tokenizer has none
            if end is not None and end != eos_token:
                log.warning(
                    "The chat template ends assistant turns with %s, but the tokenizer's "
                    "end-of-text token is %s, at which generation (and val/exact_match) stops: "
                    "set data.tokenizer.eos_token=%s",
                    end,
                    eos_token,
                    end,
                )
        return partial(
            encode_conversations,
            tokenizer=self.tokenizer,
            template=renderer,
            where=self._where(),
        )

    def _where(self) -> str:
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
        for document in self.source.split_documents(store.num_documents)[split]:
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
        # Messages of differing fields (one with reasoning_content, say) reach us as the JSON
        # text that `datasets` keeps them in.
        turns = [_json_object(turn) for turn in record["messages"]]
    else:
        shown = {k: v for k, v in record.items() if v is not None}
        raise DataError(
            f'{where} needs {{"prompt": ..., "response": ...}} or {{"messages": [...]}}, got '
            f"{str(shown)[:80]!r}"
        )
    for turn in turns:
        if not isinstance(turn, dict) or turn.get("role") not in ROLES:
            raise DataError(f"{where}: every message needs a role among {ROLES}, got {turn!r}")
        if not isinstance(turn.get("content"), str):
            raise DataError(f"{where}: the {turn['role']} message's content must be a string")
    if not turns or turns[-1]["role"] != "assistant":
        raise DataError(f"{where}: the conversation must end with an assistant message")
    return turns


def _json_object(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def render(
    conversation: list[dict[str, str]], template: dict[str, str]
) -> list[tuple[str | None, bool]]:
    """The conversation as (text, is target) pieces; None stands for the end-of-turn token."""
    pieces: list[tuple[str | None, bool]] = []
    for turn in conversation:
        if turn["role"] == "assistant":
            pieces += [(template["assistant"], False), (turn["content"], True), (None, True)]
        else:
            pieces.append((template[turn["role"]].format(content=turn["content"]), False))
    return pieces


def render_rows(
    records: list[dict[str, Any]],
    indices: list[int],
    template: dict[str, str] | ChatTemplate,
    where: str,
) -> Sequence[Sequence[tuple[str | None, bool]]]:
    """The (text, is target) pieces of each record, by format strings or by a chat template.

    A chat template renders all the batch's conversations together.
    """
    conversations = [
        conversation_of(record, where, index)
        for record, index in zip(records, indices, strict=True)
    ]
    if isinstance(template, ChatTemplate):
        return template.render(conversations, [f"{where}, row {index + 1}" for index in indices])
    return [render(conversation, template) for conversation in conversations]


def encode_conversations(
    table: pa.Table,
    indices: list[int],
    tokenizer,
    template: dict[str, str] | ChatTemplate,
    where: str,
) -> pa.Table:
    """`Dataset.map`'s function: each conversation's token ids and target mask.

    Every text piece of the batch is encoded in one call.
    """
    texts, is_end, is_target, pieces_per_row = [], [], [], []
    for pieces in render_rows(table.to_pylist(), indices, template, where):
        texts += [text for text, _ in pieces if text is not None]
        is_end += [text is None for text, _ in pieces]
        is_target += [target for _, target in pieces]
        pieces_per_row.append(len(pieces))
    values, text_lengths = tokenizer.encode_batch(texts)
    ends = np.array(is_end, dtype=bool)
    piece_lengths = np.ones(len(ends), dtype=np.int64)
    piece_lengths[~ends] = text_lengths
    from_text = np.repeat(~ends, piece_lengths)
    tokens = np.full(len(from_text), tokenizer.eos_token_id, dtype=np.int64)
    tokens[from_text] = values
    targets = np.repeat(np.array(is_target, dtype=bool), piece_lengths)
    row_starts = np.concatenate(([0], np.cumsum(pieces_per_row)[:-1]))
    lengths = np.add.reduceat(piece_lengths, row_starts) if len(row_starts) else piece_lengths
    return pa.table(
        {
            "input_ids": list_column(tokens, lengths, token_dtype(tokenizer.vocab_size)),
            "targets": list_column(targets, lengths, np.dtype(np.uint8)),
        }
    )
