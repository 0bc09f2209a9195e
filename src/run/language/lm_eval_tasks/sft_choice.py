"""Make the questions of the `sft_choice` task from the synthetic instruction set.

Each prompt of src/data/text/synthetic_sft.py comes with its right answer among three answers of
the same task to other inputs.

A model fine-tuned on `experiment=lm_sft` has seen such prompts answered, so it can beat the
25% of chance after a short run; lm-eval reads the questions from `sft_choice.jsonl`, which
`write_questions()` wrote (tests/run/test_evaluate_lm.py checks that it still would).
"""

import json
import random
from pathlib import Path

import datasets

from src.data.text.synthetic_sft import TASKS
from src.utils.files import write_atomically

QUESTIONS = Path(__file__).with_name("sft_choice.jsonl")
# The tasks with short answers: scoring four 60-word phrases per question would add little.
SHORT_TASKS = ("add", "subtract", "multiply", "reverse", "upper", "sort_letters")
CHOICES = 4


def make_questions(per_task: int = 20, seed: int = 17) -> list[dict]:
    """Make `per_task` questions of each short task; the same seed gives the same questions.

    Each is {"task", "prompt", "choices", "answer"}, where `answer` is the index of the right
    choice.
    """
    rng = random.Random(seed)
    questions = []
    for _ in range(per_task):  # the tasks in turn, so that the first N (limit=N) mix them all
        for name in SHORT_TASKS:
            prompt, answer = TASKS[name](rng)
            drawn = {answer}
            while len(drawn) < CHOICES:
                drawn.add(TASKS[name](rng)[1])
            choices = sorted(drawn)  # a set of strings has another order in each process
            rng.shuffle(choices)
            index = choices.index(answer)
            questions.append({"task": name, "prompt": prompt, "choices": choices, "answer": index})
    return questions


def write_questions(path: Path = QUESTIONS) -> None:
    text = "".join(json.dumps(question) + "\n" for question in make_questions())
    write_atomically(path, text.encode("utf-8"), what="JSONL file")


def load(**metadata):
    """Load the questions as lm-eval's `custom_dataset`: a DatasetDict with one `test` split.

    lm-eval passes its metadata, which the questions do not depend on.
    """
    rows = [json.loads(line) for line in QUESTIONS.read_text().splitlines()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
