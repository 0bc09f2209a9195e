"""A Hydra sweeper that runs an Optuna study through Optuna's ask/tell API.

It takes the configs of Hydra's Optuna sweeper (hydra-optuna-sweeper), with their meaning, on the
stable Hydra 1.3 and Optuna 5: the release for Hydra 1.3 pins optuna<3 and with it
SQLAlchemy<2, and the one for Optuna 4-5 comes with Hydra 1.4, a pre-release that Hydra's own
guide keeps out of production and that rejects `hydra.mode: MULTIRUN` in a group config such as
conf/hparams_search/optuna.yaml. Ask/tell keeps it a short loop: ask for a batch of `n_jobs`
trials, launch them as one batch of jobs numbered after their trials, tell the study how each
ended, until the study holds `n_trials` (every launch that shares it counts them).

Only the glue to Hydra is here; the search space (src/run/search/space.py) and the study
(src/run/search/study.py) are the project's, imported when a search starts, not each time
Hydra scans its plugins.
"""

import logging
from pathlib import Path
from typing import Any

from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from hydra.utils import get_method
from omegaconf import DictConfig

log = logging.getLogger(__name__)


class OptunaSweeper(Sweeper):
    def __init__(
        self,
        sampler: DictConfig,
        pruner: DictConfig,
        direction: Any,
        storage: str | None,
        study_name: str | None,
        n_trials: int,
        n_jobs: int,
        max_failure_rate: float,
        params: DictConfig | None,
        custom_search_space: str | None = None,
        search_space: DictConfig | None = None,
        heartbeat_interval: int | None = None,
    ):
        self.sampler = sampler
        self.pruner = pruner
        self.direction = direction
        self.storage = storage
        self.study_name = study_name
        self.n_trials = n_trials
        self.n_jobs = n_jobs
        self.max_failure_rate = max_failure_rate
        self.params = params
        self.custom_search_space = custom_search_space
        self.search_space = search_space
        self.heartbeat_interval = heartbeat_interval

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> None:
        from src.utils.error_boundary import exit_in_one_line

        exit_in_one_line(self.search)(arguments)  # a bad search space: one line, no traceback

    def search(self, arguments: list[str]) -> None:
        """Ask, launch and tell batches until the study holds n_trials or one fails too often."""
        from src.run.search.heartbeat import fail_stale_trials
        from src.run.search.results import write_results
        from src.run.search.space import grid_space, param_lines, search_space
        from src.run.search.study import open_study, study_directions
        from src.utils.optuna_storage import shown

        check_failure_rate(self.max_failure_rate)
        check_counts(self.n_jobs, self.heartbeat_interval)
        directions = study_directions(self.direction)
        check_pruning(directions, self.pruner)
        distributions, fixed, deletions = search_space(self.params, arguments, self.search_space)
        n_trials, grid = self.n_trials, None
        if self.sampler.get("_partial_"):  # the grid sampler, which takes the grid to run
            grid = grid_space(distributions, [*param_lines(self.params), *arguments])
            n_trials = min(n_trials, grid_size(grid))
            log.info("The grid holds %d points: %d trials.", grid_size(grid), n_trials)
        study = open_study(
            self.storage,
            self.study_name,
            directions,
            self.sampler,
            self.pruner,
            grid,
            self.heartbeat_interval,
        )
        held = len(study.trials)
        log.info(
            "Study %r in %s: %d of its %d trials so far, %d at a time.",
            study.study_name, shown(self.storage), held, n_trials, self.n_jobs,
        )  # fmt: skip
        if held >= n_trials:
            log.warning(
                "Study %r already holds %d trials, hydra.sweeper.n_trials=%d: nothing to run "
                "(raise n_trials to run more).",
                study.study_name, held, n_trials,
            )  # fmt: skip
        trials = TrialMaker(
            study, distributions, fixed, deletions, self.custom_search_space, n_trials
        )
        try:
            while batch := trials.ask_batch(self.config, self.n_jobs):
                self.run_batch(trials, batch)
                fail_stale_trials(study)  # another launch's, whose heartbeat stopped
        finally:
            write_results(study, Path(self.config.hydra.sweep.dir) / "optimization_results.yaml")

    def run_batch(self, trials: "TrialMaker", batch: list[Any]) -> None:
        """Run the batch's trials, tell the study; stop when too many of them failed."""
        from optuna.trial import TrialState

        from src.run.search.heartbeat import heartbeats
        from src.run.search.study import FAIL_REASON, tell
        from src.utils.errors import UserFacingError

        failed = []
        for run in consecutive_runs(batch):
            overrides = [trials.overrides(trial) for trial in run]
            with heartbeats(trials.study, run):
                jobs = self.launcher.launch(overrides, initial_job_idx=run[0].number)
            for trial, job in zip(run, jobs, strict=True):
                told = tell(trials.study, trial, job)
                log.info("Trial %d: %s, %s", trial.number, told.state.name, told.params)
                if told.state == TrialState.FAIL:
                    failed.append(told)
        if len(failed) / len(batch) > self.max_failure_rate:
            raise UserFacingError(
                f"{len(failed)} of the {len(batch)} trials of the last batch failed, more than "
                f"hydra.sweeper.max_failure_rate={self.max_failure_rate}, so the search stopped "
                f"(trial {failed[0].number}: {failed[0].user_attrs.get(FAIL_REASON)}); raise "
                f"max_failure_rate (up to 1.0) to go on past failures."
            )


class TrialMaker:
    """Asks the study for trials of the search space, each with its overrides for the launcher.

    A trial samples the distributions, records the fixed values as user attributes (as Hydra's
    Optuna sweeper does), then the `custom_search_space` function, if any, suggests more. No
    trial is asked once the study holds `n_trials`, whichever launches asked them.
    """

    def __init__(
        self,
        study: Any,
        distributions: dict[str, Any],
        fixed: dict[str, str],
        deletions: list[str],
        custom_search_space: str | None,
        n_trials: int,
    ):
        self.study = study
        self.distributions = distributions
        self.fixed = fixed
        self.deletions = deletions
        self.extend = custom_function(custom_search_space) if custom_search_space else None
        self.n_trials = n_trials

    def ask_batch(self, config: DictConfig, size: int) -> list[Any]:
        """Up to `size` new trials: fewer, or none, where the study reaches n_trials."""
        batch: list[Any] = []
        while len(batch) < size and (trial := self.ask(config)) is not None:
            batch.append(trial)
        return batch

    def ask(self, config: DictConfig) -> Any:
        """A new trial, or None once the study holds n_trials."""
        from src.run.search.study import ask
        from src.utils.errors import ConfigError

        trial = ask(self.study, self.distributions, self.n_trials)
        if trial is None:
            return None
        for key, value in self.fixed.items():
            trial.set_user_attr(key, value)
        if self.extend is not None:
            self.extend(config, trial)
            overlap = sorted(trial.params.keys() & self.fixed.keys())
            if overlap:
                raise ConfigError(
                    f"hydra.sweeper.custom_search_space suggests {overlap}, which the command "
                    f"line or hydra.sweeper.params fixes: drop one of the two."
                )
        return trial

    def overrides(self, trial: Any) -> list[str]:
        from src.run.search.space import trial_overrides

        return trial_overrides(trial.params, self.fixed, self.deletions)


def custom_function(path: str) -> Any:
    """The function `hydra.sweeper.custom_search_space` names by its dotted path."""
    from src.utils.errors import ConfigError

    try:
        # Hydra's Optuna sweeper documents the path with a leading dot, which Hydra refuses.
        return get_method(path.lstrip("."))
    except (ImportError, ValueError) as error:
        raise ConfigError(
            f"hydra.sweeper.custom_search_space={path!r} names no function (module.function, "
            f"importable from the app's folder): {error}"
        ) from error


def check_pruning(directions: list[str], pruner: DictConfig) -> None:
    """Refuse a pruner for several objectives: Optuna prunes single-objective studies only."""
    from src.utils.errors import ConfigError

    if len(directions) > 1 and pruner.get("_target_") != "optuna.pruners.NopPruner":
        raise ConfigError(
            f"hydra.sweeper.direction={directions} with a pruner: Optuna prunes single-objective "
            f"searches only. Use hparams_search=optuna_multi_objective, or set "
            f"hydra/sweeper/pruner=none and callbacks.optuna_pruning=null."
        )


def check_failure_rate(rate: float) -> None:
    from src.utils.errors import ConfigError

    if not 0.0 <= rate <= 1.0:
        raise ConfigError(
            f"hydra.sweeper.max_failure_rate={rate}: it is the share of a batch's trials that "
            f"may fail, from 0.0 (none) to 1.0 (all)."
        )


def check_counts(n_jobs: int, heartbeat_interval: int | None) -> None:
    from src.utils.errors import ConfigError

    if n_jobs < 1:
        raise ConfigError(
            f"hydra.sweeper.n_jobs={n_jobs}: it is how many trials run at once, 1 or more."
        )
    if heartbeat_interval is not None and heartbeat_interval < 1:
        raise ConfigError(
            f"hydra.sweeper.heartbeat_interval={heartbeat_interval}: give the seconds between "
            f"heartbeats (1 or more), or null for none."
        )


def grid_size(grid: dict[str, list[Any]]) -> int:
    size = 1
    for values in grid.values():
        size *= len(values)
    return size


def consecutive_runs(trials: list[Any]) -> list[list[Any]]:
    """The trials in runs of consecutive numbers: a launcher numbers the jobs of a batch one
    after another, and another process asking the same study can take the numbers between."""
    runs: list[list[Any]] = []
    for trial in trials:
        if runs and trial.number == runs[-1][-1].number + 1:
            runs[-1].append(trial)
        else:
            runs.append([trial])
    return runs
