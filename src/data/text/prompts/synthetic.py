"""A synthetic prompt set with a verifiable answer: sums of two small numbers.

Each row is TRL's standard prompt format plus the column the rewards read: `{"prompt": "3+4=",
"answer": "7"}`. The sums stay below 10, so that every answer is one token of any tokenizer
and a model answering at random is right one time in ten among the digits (and far less often
among a whole vocabulary).
"""

import random


def make_sums(count: int, seed: int = 0) -> list[dict[str, str]]:
    """`count` rows "a+b=", drawn from the 55 pairs with a + b < 10; the same seed, same rows.

    The commonest answer, 9, is that of 10 pairs in 55: no single answer scores above 0.18.
    """
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10) for b in range(10 - a)]
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in rng.choices(pairs, k=count)]
