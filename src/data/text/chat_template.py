r"""Conversations rendered with a tokenizer folder's own chat template (`data.template=tokenizer`).

The template is the folder's `chat_template.jinja`, else `tokenizer_config.json`'s
`chat_template`, rendered by transformers' `apply_chat_template`. Templates such as Qwen3's mark
no generation spans, so the supervised spans come from rendering prefixes: for the assistant
message i, `messages[:i]` with the generation prompt is where its turn starts, and
`messages[:i + 1]` without it is the turn as the model writes it. The document is the whole
conversation's rendering, cut into (text, supervised) pieces at those places:

- supervised: each assistant turn after its generation prompt, through its end-of-turn token
  (the last special token the template writes after the content, `<|im_end|>` in ChatML);
  what follows that token (ChatML's newline) belongs to the next prompt, since generation
  stops at the token. An empty assistant turn supervises just its end-of-turn token, plus
  whatever the template writes for it (Qwen3's empty `<think>\n\n</think>\n\n`).
- A template may write an earlier assistant turn shorter once later turns follow, by dropping
  its beginning: Qwen3 drops the `<think>` block (given in the content or as
  `reasoning_content`) of every assistant turn before the last user message, and writes one
  for the turns after it that have reasoning and for the last turn (empty if it has none).
  An earlier turn that the template shortens is supervised as the whole
  conversation renders it (its answer, without reasoning). Any other difference between a
  prefix's rendering and the whole conversation's is refused with a DataError naming the row.

Each piece is tokenised on its own, as generation sees a prompt and then writes its answer.
"""

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from src.utils.errors import ConfigError, DataError, MissingFileError

TEMPLATE_FILE = "chat_template.jinja"

Messages = list[dict[str, Any]]
Pieces = list[tuple[str, bool]]


def read_chat_template(folder: Path) -> str:
    """The folder's chat template text, or a ConfigError that says where it was looked for."""
    if not folder.is_dir():
        raise MissingFileError(
            f"data.tokenizer.path={str(folder)!r} is not a folder: point it at a Hugging Face "
            f"model folder with tokenizer.json and a chat template (e.g. Qwen3-0.6B)"
        )
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text()
    config_path = folder / "tokenizer_config.json"
    template = None
    if config_path.is_file():
        template = json.loads(config_path.read_text()).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    if not isinstance(template, str) or not template.strip():
        raise ConfigError(
            f"data.template=tokenizer renders conversations with the chat template of "
            f"data.tokenizer.path={str(folder)!r}, but that folder has none (no {TEMPLATE_FILE} "
            f"and no chat_template in tokenizer_config.json). Point data.tokenizer.path at a "
            f"chat model's folder (e.g. Qwen3-0.6B), add a {TEMPLATE_FILE} there, or give "
            f"data.template as format strings (conf/data/sft.yaml)"
        )
    return template


class ChatTemplate:
    """A tokenizer folder's chat template, rendering conversations into (text, supervised) pieces.

    Picklable for `Dataset.map` workers: each loads the transformers tokenizer once.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.text = read_chat_template(self.folder)
        config = self.folder / "tokenizer_config.json"
        self.config = config.read_text() if config.is_file() else ""
        self._tokenizer = None
        self._end_tokens: re.Pattern | None = None

    @property
    def key(self) -> str:
        """Identifies the rendering (template and special tokens), for the token store's key."""
        return hashlib.sha256(f"{self.text}\0{self.config}".encode()).hexdigest()[:16]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokenizer": None, "_end_tokens": None}

    @property
    def tokenizer(self):
        """The transformers tokenizer of the folder, which supplies `apply_chat_template`.

        It also supplies the special tokens the template may name (`bos_token`, `eos_token`).
        """
        if self._tokenizer is None:
            from transformers import PreTrainedTokenizerFast  # slow to import: when first used

            self._tokenizer = PreTrainedTokenizerFast.from_pretrained(
                self.folder, local_files_only=True
            )
        return self._tokenizer

    def render(self, conversations: list[Messages], wheres: list[str]) -> list[Pieces]:
        """Each conversation's rendering as (text, supervised) pieces (see the module docstring).

        `wheres` name the conversations in errors.
        """
        chats = [[_plain(message) for message in turns] for turns in conversations]
        turns = [[i for i, m in enumerate(chat) if m["role"] == "assistant"] for chat in chats]
        fulls = self._render(chats, wheres, generation=False)
        prompts = self._render_prefixes(chats, turns, wheres, generation=True)
        replies = self._render_prefixes(chats, turns, wheres, generation=False)
        pieces = []
        for full, chat, where, ts in zip(fulls, chats, wheres, turns, strict=True):
            turn_prompts = [next(prompts) for _ in ts]
            turn_replies = [next(replies) if i + 1 < len(chat) else full for i in ts]
            pieces.append(self._split(full, turn_prompts, turn_replies, where))
        return pieces

    def _render_prefixes(
        self, chats: list[Messages], turns: list[list[int]], wheres: list[str], generation: bool
    ) -> Iterator[str]:
        """The renderings of each assistant message's prompt or turn, in order, in one call.

        With `generation`, its prompt: the messages before it and the generation prompt; else its
        turn: the messages through it (left out where that is the whole chat, already rendered).
        """
        prefixes, owners = [], []
        for chat, ts, where in zip(chats, turns, wheres, strict=True):
            ends = ts if generation else [i + 1 for i in ts if i + 1 < len(chat)]
            prefixes += [chat[:end] for end in ends]
            owners += [where] * len(ends)
        return iter(self._render(prefixes, owners, generation))

    def _split(self, full: str, prompts: list[str], replies: list[str], where: str) -> Pieces:
        """`full` cut into pieces at each assistant turn, located by its prefix renderings."""
        pieces, cursor = [], 0
        for turn, (prompt, reply) in enumerate(zip(prompts, replies, strict=True), start=1):
            start = len(prompt)
            if not full.startswith(prompt) or start < cursor:
                raise self._unstable(where, turn, "the prompt")
            if not reply.startswith(prompt):
                raise DataError(
                    f"{where}: the chat template of {self.folder} does not start assistant turn "
                    f"{turn} with its own generation prompt (add_generation_prompt=True), so the "
                    f"answer cannot be told from the prompt"
                )
            end = self._last_special(reply, start)  # the end-of-turn token
            answer = reply[start : end.end() if end else len(reply)]
            if not full.startswith(answer, start):  # rendered differently once turns follow
                found = full.find(end.group(), start) if end else -1
                stop = found + len(end.group()) if end else -1
                if found < 0 or not answer.endswith(full[start:stop]):
                    raise self._unstable(where, turn, "the answer")
                answer = full[start:stop]
            pieces += [(full[cursor:start], False), (answer, True)]
            cursor = start + len(answer)
        pieces.append((full[cursor:], False))
        return [(text, supervised) for text, supervised in pieces if text]

    def end_of_turn_token(self) -> str | None:
        """The special token that ends an assistant turn, from a probe conversation, or None."""
        probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]
        try:
            (prompt,) = self._render([probe[:1]], ["a probe"], generation=True)
            (reply,) = self._render([probe], ["a probe"], generation=False)
        except DataError:
            return None
        end = self._last_special(reply, len(prompt)) if reply.startswith(prompt) else None
        return end.group() if end else None

    def _last_special(self, text: str, start: int) -> re.Match | None:
        """The last special token (of the tokenizer's added tokens) in `text[start:]`."""
        if self._end_tokens is None:
            added = self.tokenizer.added_tokens_decoder.values()
            special = sorted((t.content for t in added if t.special), key=len, reverse=True)
            self._end_tokens = re.compile("|".join(map(re.escape, special)) or "(?!)")
        matches = list(self._end_tokens.finditer(text, start))
        return matches[-1] if matches else None

    def _render(self, chats: list[Messages], wheres: list[str], generation: bool) -> list[str]:
        if not chats:
            return []
        options = {"tokenize": False, "chat_template": self.text}
        tokenizer = self.tokenizer
        try:
            return tokenizer.apply_chat_template(chats, add_generation_prompt=generation, **options)
        except Exception as batch_error:  # find the conversation to name
            for chat, where in zip(chats, wheres, strict=True):
                try:
                    tokenizer.apply_chat_template(
                        [chat], add_generation_prompt=generation, **options
                    )
                except Exception as error:
                    raise DataError(
                        f"{where}: the chat template of {self.folder} cannot render the "
                        f"conversation's first {len(chat)} messages: {error}"
                    ) from error
            raise batch_error

    def _unstable(self, where: str, turn: int, what: str) -> DataError:
        return DataError(
            f"{where}: the chat template of {self.folder} is not prefix-stable here: the whole "
            f"conversation's rendering does not hold {what} of assistant turn {turn} as the "
            f"conversation up to that turn renders it, so the turn's supervised tokens cannot "
            f"be located. Only dropping the beginning of an earlier assistant turn is allowed "
            f"(as Qwen3 drops <think> blocks); fix the template or split the conversation"
        )


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """A message without the null fields that a dataset's shared schema adds to it.

    transformers 5 drops them as well, and 4.x passes them to the template.
    """
    return {key: value for key, value in message.items() if value is not None}
