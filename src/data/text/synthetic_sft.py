"""A synthetic instruction set whose answers can be checked exactly: arithmetic and string tasks.

Validation loss says little about whether a fine-tuned model follows instructions; exact-match
accuracy of its greedy answers on held-out prompts does. Every task here has one right answer,
and prompt lengths follow a long tail (the `repeat` and `reverse_words` tasks), as real
instruction data does.

    python scripts/make_sft_data.py --out data/sft.jsonl --count 5000 --seed 0
"""

import json
import random
import string
from collections.abc import Callable
from pathlib import Path

from src.utils.files import write_atomically

WORDS = (
    "apple", "river", "stone", "light", "cloud", "garden", "window", "silver", "forest",
    "candle", "bridge", "paper", "music", "winter", "orange", "mirror", "yellow", "island",
    "rocket", "planet", "shadow", "thunder", "marble", "pepper",
)  # fmt: skip


def _number(rng: random.Random) -> int:
    return rng.randint(0, 99)


def _word(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8)))


def _phrase(rng: random.Random) -> list[str]:
    """A phrase of 1 to ~60 words, most of them short: a long tail of lengths."""
    return rng.choices(WORDS, k=min(60, 1 + int(rng.paretovariate(1.2))))


def add(rng: random.Random) -> tuple[str, str]:
    a, b = _number(rng), _number(rng)
    return f"{a}+{b}=", str(a + b)


def subtract(rng: random.Random) -> tuple[str, str]:
    a, b = _number(rng), _number(rng)
    return f"{a}-{b}=", str(a - b)


def multiply(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 12), rng.randint(0, 12)
    return f"{a}*{b}=", str(a * b)


def reverse(rng: random.Random) -> tuple[str, str]:
    word = _word(rng)
    return f"reverse {word}", word[::-1]


def upper(rng: random.Random) -> tuple[str, str]:
    word = _word(rng)
    return f"upper {word}", word.upper()


def sort_letters(rng: random.Random) -> tuple[str, str]:
    word = _word(rng)
    return f"sort {word}", "".join(sorted(word))


def repeat(rng: random.Random) -> tuple[str, str]:
    phrase = " ".join(_phrase(rng))
    return f"repeat {phrase}", phrase


def reverse_words(rng: random.Random) -> tuple[str, str]:
    phrase = _phrase(rng)
    return f"backwards {' '.join(phrase)}", " ".join(reversed(phrase))


TASKS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    task.__name__: task
    for task in (add, subtract, multiply, reverse, upper, sort_letters, repeat, reverse_words)
}


def make_examples(count: int, seed: int = 0, chat_fraction: float = 0.25) -> list[dict]:
    """`count` examples; the same seed gives the same examples.

    `chat_fraction` of them are in the chat form {"messages": [...]} and the rest are
    {"prompt": ..., "response": ...}.
    """
    rng = random.Random(seed)
    examples: list[dict[str, str | list[dict[str, str]]]] = []
    for _ in range(count):
        prompt, response = TASKS[rng.choice(list(TASKS))](rng)
        if rng.random() < chat_fraction:
            messages = [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": response},
            ]
            examples.append({"messages": messages})
        else:
            examples.append({"prompt": prompt, "response": response})
    return examples


def write_jsonl(examples: list[dict], path: Path) -> None:
    """One JSON object per line, written atomically (ranks may create the same file at once)."""
    text = "".join(json.dumps(example) + "\n" for example in examples)
    write_atomically(path, text.encode("utf-8"), what="JSONL file")
