"""Reward functions for GRPO, and the weighted set of them a run optimises.

A reward function takes TRL's arguments: `prompts` (each row's prompt as given: a text or
messages), `completions` (texts; for a conversational prompt, a one-message list `[{"role":
"assistant", "content": ...}]`), `completion_ids` (token id lists), and every other column of the
prompt rows by name (`answer`, say). It returns one float per completion, or None where it has
no opinion (that completion's weighted sum then leaves it out). The two here are Hydra targets
(conf/reward/); a user's own is any callable with that signature.
"""

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from src.utils.errors import ConfigError, DataError

RewardFunction = Callable[..., Sequence[float | None]]


def completion_text(completion: str | list[dict[str, str]]) -> str:
    """A completion's text, whether plain or an assistant message."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


class ExactMatch:
    """1.0 where the completion is the row's `column` (e.g. `answer`), surrounding spaces aside."""

    def __init__(self, column: str = "answer"):
        self.column = column

    def __call__(self, completions: Sequence[Any], **columns: Any) -> list[float]:
        if self.column not in columns:
            known = sorted(set(columns) - {"prompts", "completion_ids"})
            raise DataError(
                f"reward=exact_match compares completions with the prompt rows' column "
                f"{self.column!r}, which they lack (their columns: {known}): add it, or set "
                f"its column option to one of them"
            )
        answers = columns[self.column]
        return [
            float(completion_text(completion).strip() == str(answer).strip())
            for completion, answer in zip(completions, answers, strict=True)
        ]


class RegexFormat:
    """1.0 where the whole completion matches `pattern` (Python's `re.fullmatch`), else 0."""

    def __init__(self, pattern: str, dotall: bool = True):
        try:
            self.pattern = re.compile(pattern, re.DOTALL if dotall else 0)
        except re.error as error:
            raise ConfigError(
                f"reward=regex_format: pattern {pattern!r} is no regex: {error}"
            ) from None

    def __call__(self, completions: Sequence[Any], **columns: Any) -> list[float]:
        return [float(self.pattern.fullmatch(completion_text(c)) is not None) for c in completions]


class Rewards:
    """Named reward functions and their weights: each scored apart, and their weighted sum.

    `specs` maps a name to `{"function": callable, "weight": float}` (conf/reward/*.yaml).
    """

    def __init__(self, specs: Mapping[str, Mapping[str, Any]]):
        self.functions: dict[str, RewardFunction] = {}
        self.weights: dict[str, float] = {}
        for name, spec in specs.items():
            if not callable(spec.get("function")):
                raise ConfigError(
                    f"reward.{name}.function must be a callable (a _target_ with _partial_: "
                    f"true for a plain function), got {spec.get('function')!r}"
                )
            self.functions[name] = spec["function"]
            self.weights[name] = float(spec.get("weight", 1.0))

    @property
    def names(self) -> list[str]:
        return list(self.functions)

    def check_some(self) -> None:
        """Refuse to train or evaluate without a reward function."""
        if not self.functions:
            raise ConfigError(
                "model.objective=grpo needs at least one reward function: choose reward="
                "exact_match, reward=regex_format, several as reward=[exact_match,regex_format], "
                "or add your own (docs/post-training.md)"
            )

    def score(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]],
        columns: Mapping[str, list],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The weighted sum [N] of every function's scores, and each function's [N] (NaN: None).

        Unscored completions add nothing to the sum (TRL's `nansum`).
        """
        scores = {}
        for name, function in self.functions.items():
            values = function(
                prompts=prompts, completions=completions, completion_ids=completion_ids, **columns
            )
            values = list(values)
            if len(values) != len(completions):
                raise DataError(
                    f"reward.{name} returned {len(values)} scores for {len(completions)} "
                    f"completions: it must return one per completion (None where it has none)"
                )
            scores[name] = torch.tensor(
                [math.nan if v is None else float(v) for v in values], dtype=torch.float64
            )
        weighted = torch.stack([self.weights[n] * s for n, s in scores.items()])
        return weighted.nansum(0), scores
