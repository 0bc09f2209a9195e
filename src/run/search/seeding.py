"""Seed a launch's sampler with the seed plus the number of the first trial it samples.

A resumed search then draws new values instead of repeating the first run's, launches that
share a study draw different values (the storage gives their first trials different numbers),
and the same command on the same study still draws the same ones.
"""

from collections.abc import Callable, Sequence
from typing import Any

from optuna import Study
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial, TrialState


class SeededAtFirstTrial(BaseSampler):
    """The sampler `build(seed + number)` builds when the launch's first trial, `number`, starts.

    Optuna starts each trial with `before_trial`, before it samples anything for it; every other
    call goes to the sampler built then.
    """

    def __init__(self, build: Callable[[int], BaseSampler], seed: int):
        self.build = build
        self.seed = seed
        self.sampler: BaseSampler | None = None

    def before_trial(self, study: Study, trial: FrozenTrial) -> None:
        if self.sampler is None:
            self.sampler = self.build(self.seed + trial.number)
        self.sampler.before_trial(study, trial)

    def infer_relative_search_space(
        self, study: Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        return self.built().infer_relative_search_space(study, trial)

    def sample_relative(
        self, study: Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        return self.built().sample_relative(study, trial, search_space)

    def sample_independent(
        self,
        study: Study,
        trial: FrozenTrial,
        param_name: str,
        param_distribution: BaseDistribution,
    ) -> Any:
        return self.built().sample_independent(study, trial, param_name, param_distribution)

    def after_trial(
        self,
        study: Study,
        trial: FrozenTrial,
        state: TrialState,
        values: Sequence[float] | None,
    ) -> None:
        self.built().after_trial(study, trial, state, values)

    def built(self) -> BaseSampler:
        if self.sampler is None:
            raise RuntimeError("the sampler is built when this launch's first trial starts")
        return self.sampler
