"""Preference rows in TRL's standard formats, read as one prompt and two responses to it.

A row is one of

- plain text: `{"prompt": str, "chosen": str, "rejected": str}`, the prompt a user turn and
  each response an assistant turn;
- conversational: `{"prompt": [messages], "chosen": [messages], "rejected": [messages]}`, each
  message `{"role", "content"}`, the responses' messages ending with an assistant turn;
- implicit prompt: only `chosen` and `rejected`, both texts or both message lists, whose shared
  beginning is the prompt: the messages they share, or for texts their common start cut back
  to the last whitespace in it, so that no word is split between prompt and response (the
  whitespace between them is dropped).

Each pair becomes two conversations, the prompt followed by either response; only the
response's assistant turns are targets (`render_pair`). Anything else is a DataError naming the
row: a missing or empty response, mixed formats, a prompt that cannot be told.
"""

import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from src.data.text.chat_template import ChatTemplate
from src.data.text.conversations import Pieces, checked_turns, render_conversations
from src.utils.errors import DataError

Messages = list[dict[str, str]]
SIDES = ("chosen", "rejected")


class PreferencePair(NamedTuple):
    """A prompt's messages and the messages of its two responses."""

    prompt: Messages
    chosen: Messages
    rejected: Messages


def pair_of(record: dict[str, Any], where: str) -> PreferencePair:
    """One row as a `PreferencePair`; a DataError naming `where` (the row) otherwise."""
    chosen, rejected = record.get("chosen"), record.get("rejected")
    if chosen is None or rejected is None:
        missing = [side for side in SIDES if record.get(side) is None]
        raise DataError(
            f"{where} has no {' and no '.join(missing)}: every row needs chosen and rejected "
            f"responses (and a prompt, unless they begin with it)"
        )
    prompt = record.get("prompt")
    if prompt is None:
        prompt, chosen, rejected = split_implicit_prompt(chosen, rejected, where)
    elif isinstance(prompt, str):
        if not (isinstance(chosen, str) and isinstance(rejected, str)):
            raise DataError(f"{where}: a text prompt takes text responses, not message lists")
        prompt = [{"role": "user", "content": prompt}]
        chosen = [{"role": "assistant", "content": chosen}]
        rejected = [{"role": "assistant", "content": rejected}]
    pair = PreferencePair(
        checked_turns(prompt, f"{where}, prompt"),
        checked_turns(chosen, f"{where}, chosen"),
        checked_turns(rejected, f"{where}, rejected"),
    )
    for side in SIDES:
        response = getattr(pair, side)
        if not response or response[-1]["role"] != "assistant":
            raise DataError(f"{where}: the {side} response must end with an assistant message")
        if not response[-1]["content"].strip():
            raise DataError(f"{where}: the {side} response is empty")
    return pair


def split_implicit_prompt(chosen: Any, rejected: Any, where: str) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of a row whose responses begin with the prompt they share."""
    if isinstance(chosen, str) and isinstance(rejected, str):
        shared = common_prefix_length(chosen, rejected)
        spaces = [m.start() for m in re.finditer(r"\s", chosen[:shared])]
        cut = spaces[-1] if spaces else shared
        prompt = chosen[:cut].rstrip()
        if not prompt:
            raise DataError(
                f"{where}: chosen and rejected share no beginning, so the prompt cannot be "
                f"told; give it as a prompt column"
            )
        return (
            [{"role": "user", "content": prompt}],
            [{"role": "assistant", "content": chosen[cut:].lstrip()}],
            [{"role": "assistant", "content": rejected[cut:].lstrip()}],
        )
    if isinstance(chosen, list) and isinstance(rejected, list):
        chosen = checked_turns(chosen, f"{where}, chosen")
        rejected = checked_turns(rejected, f"{where}, rejected")
        shared = common_prefix_length(chosen, rejected)
        if not shared:
            raise DataError(
                f"{where}: chosen and rejected share no first message, so the prompt cannot "
                f"be told; give it as a prompt column"
            )
        return chosen[:shared], chosen[shared:], rejected[shared:]
    raise DataError(f"{where}: chosen and rejected must both be texts or both message lists")


def common_prefix_length(a: Sequence, b: Sequence) -> int:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


def render_pairs(
    pairs: list[PreferencePair], wheres: list[str], template: dict[str, str] | ChatTemplate
) -> list[Pieces]:
    """Each pair's chosen then rejected conversation as (text, is target) pieces.

    Only the response's assistant turns are targets: those of the prompt are context.
    """
    conversations, names, prompt_answers = [], [], []
    for pair, where in zip(pairs, wheres, strict=True):
        for side in SIDES:
            conversations.append(pair.prompt + getattr(pair, side))
            names.append(f"{where} ({side})")
            prompt_answers.append(sum(turn["role"] == "assistant" for turn in pair.prompt))
    rendered = render_conversations(conversations, names, template)
    return [
        untargeted_answers(pieces, count)
        for pieces, count in zip(rendered, prompt_answers, strict=True)
    ]


def untargeted_answers(pieces: Pieces, count: int) -> Pieces:
    """`pieces` with the targets of their first `count` answers turned into context.

    An answer is a run of target pieces: its text (and end-of-turn token).
    """
    result, answers, in_answer = [], 0, False
    for text, target in pieces:
        if target and not in_answer:
            answers += 1
        in_answer = target
        result.append((text, target and answers > count))
    return result
