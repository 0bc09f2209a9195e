"""Conversations as token ids and target masks: their turns checked, rendered and tokenised.

What SFT (src/data/text/sft.py) and preference data (src/data/text/preference/) share. A
conversation is a list of `{"role": ..., "content": ...}` turns, roles system, user and
assistant. `data.template` renders it (`TurnTemplate`): format strings per role (`render`), or
with `template="tokenizer"` the chat template of the tokenizer folder
(`src.data.text.chat_template`). Rendered, a conversation is (text, is target) pieces, None
standing for the end-of-turn token; `encode_pieces` tokenises a batch of them at once.
"""

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa

from src.data.corpus.encoding import list_column
from src.data.corpus.readers import FORMATS, read_records
from src.data.corpus.token_store import token_dtype
from src.data.text.chat_template import ChatTemplate
from src.data.text.synthetic_sft import write_jsonl
from src.utils.errors import ConfigError, DataError

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
# Compact enough for a byte-level tokenizer. For a Qwen tokenizer use its own chat template
# (template="tokenizer"), or its ChatML as format strings:
# user: "<|im_start|>user\n{content}<|im_end|>\n", assistant: "<|im_start|>assistant\n"
DEFAULT_TEMPLATE = {"system": "{content}\n", "user": "User: {content}\n", "assistant": "Bot: "}
TOKENIZER_TEMPLATE = "tokenizer"  # data.template=tokenizer: the tokenizer folder's chat template

Pieces = Sequence[tuple[str | None, bool]]


def read_record_files(files: list[Path], work_dir: Path, not_text: str) -> datasets.Dataset:
    """The rows of JSONL, JSON and Parquet `files` as one table; `.txt` stops with `not_text`."""
    kinds = {FORMATS[path.suffix] for path in files}
    if "text" in kinds:
        raise DataError(not_text)
    parts = [
        read_records([p for p in files if FORMATS[p.suffix] == k], k, work_dir)
        for k in sorted(kinds)
    ]
    return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]


def synthetic_file(folder: Path | None, name: str, rows: Callable[[], list[dict]]) -> Path:
    """`folder/name` (in data/cache without a folder), written from `rows()` unless it exists."""
    path = (folder or Path("data/cache")) / name
    if not path.is_file():
        written = rows()
        write_jsonl(written, path)
        log.info("Wrote %d synthetic rows to %s", len(written), path)
    return path


class TurnTemplate:
    """`data.template`: format strings for each role, or the tokenizer folder's chat template.

    `system` and `user` are format strings of `{content}`; `assistant` is the text before an
    answer. `"tokenizer"` needs a pretrained tokenizer folder (`data.tokenizer.path`) with a
    chat template, read once when first used.
    """

    def __init__(self, template: dict[str, str] | str | None, tokenizer_options: dict[str, Any]):
        self.tokenizer_path = tokenizer_options.get("path")
        self.template: dict[str, str] | str  # format strings, or TOKENIZER_TEMPLATE
        if isinstance(template, str):
            check_tokenizer_template(template, tokenizer_options)
            self.template = template
        else:
            self.template = {**DEFAULT_TEMPLATE, **(template or {})}
        self.chat_template: ChatTemplate | None = None

    def renderer(self) -> dict[str, str] | ChatTemplate:
        """The format strings, or the tokenizer folder's chat template (read once)."""
        if isinstance(self.template, dict):  # a str is TOKENIZER_TEMPLATE (checked at init)
            return self.template
        if self.chat_template is None:
            assert self.tokenizer_path is not None  # check_tokenizer_template asked for one
            self.chat_template = ChatTemplate(self.tokenizer_path)
        return self.chat_template

    def key(self) -> str:
        """What identifies the rendering, for the token store's key."""
        renderer = self.renderer()
        if isinstance(renderer, ChatTemplate):
            return f"chat_template|{renderer.key}"
        return str(sorted(renderer.items()))

    def check_end_of_turn(self, tokenizer) -> None:
        """Warn when a chat template ends assistant turns with a token generation does not stop at.

        Generation (and val/exact_match) stops at the tokenizer's end-of-text token.
        """
        renderer = self.renderer()
        if not isinstance(renderer, ChatTemplate):
            return
        end = renderer.end_of_turn_token()
        eos_token = getattr(tokenizer, "eos_token", end)  # the byte tokenizer has none
        if end is not None and end != eos_token:
            log.warning(
                "The chat template ends assistant turns with %s, but the tokenizer's "
                "end-of-text token is %s, at which generation (and val/exact_match) stops: "
                "set data.tokenizer.eos_token=%s",
                end,
                eos_token,
                end,
            )


def check_tokenizer_template(template: str, tokenizer_options: dict[str, Any]) -> None:
    if template != TOKENIZER_TEMPLATE:
        raise ConfigError(
            f"data.template={template!r}: give format strings for system, user and "
            f"assistant (conf/data/sft.yaml), or {TOKENIZER_TEMPLATE!r} for the tokenizer "
            f"folder's own chat template"
        )
    kind = tokenizer_options.get("kind", "auto")
    path = tokenizer_options.get("path")
    if kind not in ("auto", "pretrained") or not path:
        raise ConfigError(
            f"data.template=tokenizer renders conversations with a tokenizer folder's chat "
            f"template, but data.tokenizer is kind={kind!r}, path={path!r}: set "
            f"data.tokenizer.kind=pretrained data.tokenizer.path=<a folder with "
            f"tokenizer.json and a chat template, e.g. Qwen3-0.6B>"
        )


def checked_turns(turns: Any, where: str) -> list[dict[str, str]]:
    """`turns` if they are messages with a known role and text content; a DataError otherwise.

    Messages of differing fields (one with reasoning_content, say) reach us as the JSON text
    that `datasets` keeps them in, and are read back here.
    """
    if not isinstance(turns, list):
        raise DataError(f"{where}: messages must be a list of {{role, content}}, got {turns!r}")
    turns = [json_object(turn) for turn in turns]
    for turn in turns:
        if not isinstance(turn, dict) or turn.get("role") not in ROLES:
            raise DataError(f"{where}: every message needs a role among {ROLES}, got {turn!r}")
        if not isinstance(turn.get("content"), str):
            raise DataError(f"{where}: the {turn['role']} message's content must be a string")
    return turns


def json_object(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def render(conversation: list[dict[str, str]], template: dict[str, str]) -> Pieces:
    """The conversation as (text, is target) pieces; None stands for the end-of-turn token."""
    pieces: list[tuple[str | None, bool]] = []
    for turn in conversation:
        if turn["role"] == "assistant":
            pieces += [(template["assistant"], False), (turn["content"], True), (None, True)]
        else:
            pieces.append((template[turn["role"]].format(content=turn["content"]), False))
    return pieces


def render_conversations(
    conversations: list[list[dict[str, str]]],
    wheres: list[str],
    template: dict[str, str] | ChatTemplate,
) -> Sequence[Pieces]:
    """The pieces of each conversation, by format strings or by a chat template.

    A chat template renders them all together; `wheres` name them in its errors.
    """
    if isinstance(template, ChatTemplate):
        return template.render(conversations, wheres)
    return [render(conversation, template) for conversation in conversations]


def encode_pieces(rendered: Sequence[Pieces], tokenizer) -> pa.Table:
    """Each rendering's token ids and target mask, as `Dataset.map` returns them.

    Every text piece of the batch is encoded in one call.
    """
    texts, is_end, is_target, pieces_per_row = [], [], [], []
    for pieces in rendered:
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
