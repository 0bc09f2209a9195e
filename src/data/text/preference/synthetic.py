"""A synthetic preference set: the synthetic instruction tasks with a right and a wrong answer.

The prompts are those of `src.data.text.synthetic_sft`; the chosen response is the right
answer and the rejected one a typical mistake: another operation's result for arithmetic (the
product for a sum, the sum otherwise), the
word left as it is for `reverse` and `sort`, only the first letter capitalised for `upper`, a
word dropped for `repeat`, the words in their own order for `backwards`. Answers are at most
`MAX_ANSWER` characters, so that a pair fits short sequences (a long prompt is cut from the
left). Rows are conversational (TRL's format), a quarter of them with an implicit prompt.
"""

import random
import re

from src.data.text.synthetic_sft import TASKS

MAX_ANSWER = 48


def wrong_answer(task: str, prompt: str, answer: str) -> str:
    """A plausible mistake for `task`'s `prompt`, never the right `answer`."""
    if task in ("add", "subtract", "multiply"):
        a, b = (int(number) for number in re.findall(r"\d+", prompt))
        wrong = str(a * b if task == "add" else a + b)
    elif task == "upper":
        wrong = answer.capitalize()
    elif task in ("reverse", "sort_letters"):
        wrong = prompt.split(" ", 1)[1]
    elif task == "repeat":
        words = answer.split(" ")
        wrong = " ".join(words[1:]) if len(words) > 1 else f"{answer} {answer}"
    else:  # reverse_words: the phrase as given
        wrong = prompt.split(" ", 1)[1]
    return wrong if wrong != answer else f"{answer} {answer}"


def make_pairs(count: int, seed: int = 0, implicit_fraction: float = 0.25) -> list[dict]:
    """`count` preference rows; the same seed gives the same rows."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        task = rng.choice(list(TASKS))
        prompt, answer = TASKS[task](rng)
        while len(answer) > MAX_ANSWER:
            prompt, answer = TASKS[task](rng)
        user = {"role": "user", "content": prompt}
        chosen = {"role": "assistant", "content": answer}
        rejected = {"role": "assistant", "content": wrong_answer(task, prompt, answer)}
        if rng.random() < implicit_fraction:
            rows.append({"chosen": [user, chosen], "rejected": [user, rejected]})
        else:
            rows.append({"prompt": [user], "chosen": [chosen], "rejected": [rejected]})
    return rows
