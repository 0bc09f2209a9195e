"""Prompt rows in TRL's standard formats, read as the messages a completion answers.

A row has a `prompt`: a text (one user turn) or a list of `{"role", "content"}` messages ending
with a user (or system) turn. Every other column is kept as it is and handed to the reward
functions by name (`answer`, say). Anything else is a DataError naming the row: no prompt, an
empty one, messages that end with the assistant's turn.
"""

from typing import Any

from src.data.text.chat_template import ChatTemplate
from src.data.text.conversations import checked_turns, render_conversations
from src.utils.errors import DataError

Messages = list[dict[str, str]]


def prompt_messages(record: dict[str, Any], where: str) -> Messages:
    """The messages of one row's prompt; a DataError naming `where` (the row) otherwise."""
    prompt = record.get("prompt")
    if prompt is None:
        columns = sorted(key for key, value in record.items() if value is not None)
        raise DataError(
            f"{where} has no prompt: every row needs a prompt (a text, or a list of "
            f"{{role, content}} messages); its columns are {columns}"
        )
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: the prompt is empty")
        return [{"role": "user", "content": prompt}]
    turns = checked_turns(prompt, f"{where}, prompt")
    if not turns:
        raise DataError(f"{where}: the prompt has no messages")
    if turns[-1]["role"] == "assistant":
        raise DataError(
            f"{where}: the prompt ends with the assistant's message; end it with the user's "
            f"turn, which the completion answers"
        )
    return turns


def render_prompts(
    prompts: list[Messages], wheres: list[str], template: dict[str, str] | ChatTemplate
) -> list[str]:
    """Each prompt's text up to where the assistant's answer begins (its generation prompt).

    Rendered as SFT renders a conversation whose answer is empty, so that a model sees the very
    text it was fine-tuned to answer.
    """
    empty_answer = [{"role": "assistant", "content": ""}]
    rendered = render_conversations([p + empty_answer for p in prompts], wheres, template)
    texts = []
    for pieces in rendered:
        before_answer = []
        for text, is_target in pieces:
            if is_target:
                break
            before_answer.append(text or "")
        texts.append("".join(before_answer))
    return texts
