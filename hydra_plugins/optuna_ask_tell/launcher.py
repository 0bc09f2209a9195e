"""A Hydra launcher that runs the jobs of a batch at once, each in a fresh process of its own.

Hydra's basic launcher runs one job after another. Here a batch of several jobs (the search's
`hydra.sweeper.n_jobs` trials, or a basic sweep's `hydra.sweeper.max_batch_size` jobs) runs in
parallel, one process per job, so that each can have its own GPU (`CUDA_VISIBLE_DEVICES` is
read once, when CUDA starts, and a process that has started it cannot move). A batch of one
job runs in this process, as the basic launcher runs it.
"""

import functools
import logging
from collections.abc import Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

log = logging.getLogger(__name__)


class ProcessLauncher(Launcher):
    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.hydra_context = hydra_context
        self.task_function = task_function
        self.config = config

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        from src.run.search.processes import run_in_processes

        setup_globals()
        state = Singleton.get_state()
        jobs = []
        for index, overrides in enumerate(job_overrides):
            number = initial_job_idx + index
            log.info("\t#%d : %s", number, " ".join(overrides))
            config = self.job_config(overrides, number)
            jobs.append(
                functools.partial(
                    execute_job, self.hydra_context, self.task_function, config, state
                )
            )
        if len(jobs) == 1:
            return [jobs[0]()]
        return [
            result if isinstance(result, JobReturn) else failed_job(overrides, result)
            for overrides, result in zip(job_overrides, run_in_processes(jobs), strict=True)
        ]

    def job_config(self, overrides: Sequence[str], number: int) -> DictConfig:
        """The job's config, composed here as Hydra's basic launcher composes it."""
        config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(config):
            config.hydra.job.id = number
            config.hydra.job.num = number
        return config


def execute_job(
    hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig, state: dict
) -> JobReturn:
    """One job, in whatever process it runs: Hydra's global state, then the task."""
    setup_globals()
    Singleton.set_state(state)
    HydraConfig.instance().set_config(config)
    return run_job(
        hydra_context=hydra_context,
        task_function=task_function,
        config=config,
        job_dir_key="hydra.sweep.dir",
        job_subdir_key="hydra.sweep.subdir",
    )


def failed_job(overrides: Sequence[str], error: BaseException) -> JobReturn:
    """The return of a job whose process ended without one (killed, out of memory)."""
    job = JobReturn(overrides=list(overrides))
    job.status = JobStatus.FAILED
    job.return_value = error
    return job
