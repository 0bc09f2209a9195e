"""Supervised fine-tuning on conversations: the loss covers the responses only.

A JSONL line is `{"prompt": ..., "response": ...}` or `{"messages": [{"role": ..., "content":
...}, ...]}` with roles system, user and assistant. Each turn is rendered with a template;
every assistant turn's content and the end-of-turn token after it are targets, nothing else is
(not the system or user turns, not the template's text).
"""

import json
import logging
from pathlib import Path
from typing import Any

import torch

from src.data.packed_text import PackedTextDataModule
from src.data.packing import Sample
from src.data.synthetic_sft import make_examples, write_jsonl
from src.data.token_cache import file_fingerprint
from src.utils.errors import ConfigError, DataError, MissingFileError

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
# Compact enough for a byte-level tokenizer. For a Qwen tokenizer use its ChatML:
# user: "<|im_start|>user\n{content}<|im_end|>\n", assistant: "<|im_start|>assistant\n"
DEFAULT_TEMPLATE = {"system": "{content}\n", "user": "User: {content}\n", "assistant": "Bot: "}


class SFTDataModule(PackedTextDataModule):
    """Conversations from a JSONL file (`path`), or, when `path` is null, the synthetic
    instruction set of `src.data.synthetic_sft` (`synthetic_count` examples by
    `synthetic_seed`, written to the cache folder so it can be read).

    `template` renders each turn: `system` and `user` are format strings of `{content}`;
    `assistant` is the text before an answer. Over-long conversations are dropped by default;
    `overlong=split` would train on conversations cut in two and needs `allow_split=true`.
    `exact_match_samples` validation prompts are answered greedily at each validation to
    report exact-match accuracy.
    """

    default_overlong = "drop"

    def __init__(
        self,
        path: str | None = None,
        template: dict[str, str] | None = None,
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
        self.template = {**DEFAULT_TEMPLATE, **(template or {})}
        self.path = Path(path) if path else None
        self.synthetic = (synthetic_count, synthetic_seed)
        self.exact_match_samples = exact_match_samples
        self.conversations: list[list[dict[str, str]]] = []

    # -- reading -----------------------------------------------------------------------------

    def jsonl_path(self) -> Path:
        if self.path is not None:
            if not self.path.is_file():
                raise MissingFileError(f"data.path={str(self.path)!r} is not a file")
            return self.path
        count, seed = self.synthetic
        folder = self.cache_dir or Path("data/cache")
        path = folder / f"sft-synthetic-{count}-{seed}.jsonl"
        if not path.is_file():
            write_jsonl(make_examples(count, seed), path)
            log.info("Wrote %d synthetic instruction examples to %s", count, path)
        return path

    def load_documents(self) -> list[list[dict[str, str]]]:
        path = self.jsonl_path()
        with path.open(encoding="utf-8") as file:
            lines = [(number, line) for number, line in enumerate(file, 1) if line.strip()]
        self.conversations = [parse_line(line, path, number) for number, line in lines]
        if not self.conversations:
            raise DataError(f"{path} holds no examples")
        return self.conversations

    def source_fingerprint(self) -> str:
        return f"sft|{file_fingerprint([self.jsonl_path()])}|{sorted(self.template.items())}"

    def document_text(self, conversation: list[dict[str, str]]) -> str:
        return "".join(text for text, _ in self.render(conversation) if text is not None)

    # -- tokens ------------------------------------------------------------------------------

    def render(self, conversation: list[dict[str, str]]) -> list[tuple[str | None, bool]]:
        """The conversation as (text, is target) pieces; None stands for the end-of-turn token."""
        pieces: list[tuple[str | None, bool]] = []
        for turn in conversation:
            if turn["role"] == "assistant":
                pieces += [(self.template["assistant"], False), (turn["content"], True)]
                pieces.append((None, True))
            else:
                pieces.append((self.template[turn["role"]].format(content=turn["content"]), False))
        return pieces

    def tokenize(self, conversation: list[dict[str, str]]) -> Sample:
        tokens, targets = [], []
        for piece, is_target in self.render(conversation):
            ids = [self.tokenizer.eos_token_id] if piece is None else self.tokenizer.encode(piece)
            tokens += ids
            targets += [is_target] * len(ids)
        return Sample(torch.tensor(tokens, dtype=torch.long), torch.tensor(targets))

    def exact_match_examples(self, split: str = "val") -> list[tuple[list[int], str]]:
        """Up to `exact_match_samples` (prompt ids, expected answer) pairs from `split`: the
        conversation up to its last answer, and that answer."""
        examples = []
        for index in self.split_documents(len(self.conversations))[split].tolist():
            conversation = self.conversations[index]
            prompt = self.tokenize(conversation[:-1]).tokens.tolist()
            prompt += self.tokenizer.encode(self.template["assistant"])
            if len(prompt) < self.max_seq_len:
                examples.append((prompt, conversation[-1]["content"]))
            if len(examples) == self.exact_match_samples:
                break
        return examples


def parse_line(line: str, path: Path, number: int) -> list[dict[str, str]]:
    """One JSONL line as a list of turns ending with an assistant turn, or a DataError naming
    the line and what is wrong with it."""
    where = f"{path}, line {number}"
    try:
        record: Any = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(f"{where} is not valid JSON: {error.msg} (column {error.colno})") from None
    if isinstance(record, dict) and {"prompt", "response"} <= record.keys():
        turns = [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["response"]},
        ]
    elif isinstance(record, dict) and isinstance(record.get("messages"), list):
        turns = record["messages"]
    else:
        raise DataError(
            f'{where} needs {{"prompt": ..., "response": ...}} or {{"messages": [...]}}, got '
            f"{line.strip()[:80]!r}"
        )
    for turn in turns:
        if not isinstance(turn, dict) or turn.get("role") not in ROLES:
            raise DataError(f"{where}: every message needs a role among {ROLES}, got {turn!r}")
        if not isinstance(turn.get("content"), str):
            raise DataError(f"{where}: the {turn['role']} message's content must be a string")
    if not turns or turns[-1]["role"] != "assistant":
        raise DataError(f"{where}: the conversation must end with an assistant message")
    return turns
