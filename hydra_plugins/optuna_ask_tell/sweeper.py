"""A Hydra sweeper that runs an Optuna study through Optuna's ask/tell API.

A plugin of the project's own, rather than Hydra's Optuna sweeper: the one for Hydra 1.3
(hydra-optuna-sweeper 1.3) pins optuna<3 and with it SQLAlchemy<2, and the one for Optuna 4-5
comes with Hydra 1.4, a pre-release that Hydra's own guide keeps out of production and that
rejects `hydra.mode: MULTIRUN` in a group config such as conf/hparams_search/optuna.yaml.
Ask/tell keeps it a short loop: ask for a batch of `n_jobs` trials, launch them as one batch
of jobs numbered after their trials, tell the study how each ended.

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
from omegaconf import DictConfig

log = logging.getLogger(__name__)


class OptunaSweeper(Sweeper):
    def __init__(
        self,
        sampler: DictConfig,
        pruner: DictConfig,
        direction: str,
        storage: str | None,
        study_name: str,
        n_trials: int,
        n_jobs: int,
        max_failure_rate: float,
        params: DictConfig | None,
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
        """Ask, launch and tell batch after batch, until n_trials or too many failures."""
        from optuna.trial import TrialState

        from src.run.search.space import search_space, trial_overrides
        from src.run.search.study import ask, open_study, tell, write_results

        distributions, fixed = search_space(self.params, arguments)
        study = open_study(self.storage, self.study_name, self.direction, self.sampler, self.pruner)
        log.info(
            "Study %r in %s: %d trials so far, %d to run, %d at a time.",
            self.study_name, self.storage, len(study.trials), self.n_trials, self.n_jobs,
        )  # fmt: skip
        failed = launched = 0
        for size in batch_sizes(self.n_trials, self.n_jobs):
            trials = [ask(study, distributions) for _ in range(size)]
            for run in consecutive_runs(trials):
                overrides = [[*fixed, *trial_overrides(trial.params)] for trial in run]
                jobs = self.launcher.launch(overrides, initial_job_idx=run[0].number)
                for trial, job in zip(run, jobs, strict=True):
                    state = tell(study, trial, job).state
                    log.info("Trial %d: %s, %s", trial.number, state.name, trial.params)
                    failed += state == TrialState.FAIL
                launched += len(run)
            if failed / launched > self.max_failure_rate:
                log.error(
                    "Search stopped: %d of %d trials failed, more than "
                    "hydra.sweeper.max_failure_rate=%s (their errors are above).",
                    failed, launched, self.max_failure_rate,
                )  # fmt: skip
                break
        write_results(study, Path(self.config.hydra.sweep.dir) / "optimization_results.yaml")


def batch_sizes(n_trials: int, n_jobs: int) -> list[int]:
    """n_trials in batches of n_jobs, the last one smaller."""
    return [min(n_jobs, n_trials - start) for start in range(0, n_trials, max(n_jobs, 1))]


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
