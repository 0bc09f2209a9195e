"""Keep the Optuna study of a hyperparameter search.

It is opened or resumed with a seeded sampler, asked for trials up to the study's total and
told how each trial's job ended; launches on one or many machines can share it.
"""

import functools
import logging
import math
import os
import socket
from enum import Enum
from pathlib import Path
from typing import Any, Literal, cast

import optuna
from hydra.core.utils import JobReturn, JobStatus
from hydra.utils import instantiate
from omegaconf import DictConfig
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial, TrialState

from src.callbacks.training.optuna_marks import PRUNED_AT_STEP
from src.run.search.heartbeat import fail_stale_trials
from src.run.search.seeding import SeededAtFirstTrial
from src.utils.error_boundary import one_line, read_job_error
from src.utils.errors import ConfigError
from src.utils.files import is_alive
from src.utils.optuna_storage import open_storage, shown

log = logging.getLogger(__name__)

# The user attribute naming the process that asked a trial, {"host": ..., "pid": ...}: a resumed
# search tells a trial left RUNNING by a killed launch from one another launch is running now.
ASKED_BY = "asked_by"
# The user attribute of a failed trial that says why, in one line.
FAIL_REASON = "fail_reason"
DIRECTIONS = ("minimize", "maximize")


def study_directions(direction: Any) -> list[str]:
    """`hydra.sweeper.direction` as a list: one objective's, or each of several objectives'."""
    items = [direction] if isinstance(direction, str | Enum) else list(direction)
    names = [item.name if isinstance(item, Enum) else item for item in items]
    if not names or any(name not in DIRECTIONS for name in names):
        raise ConfigError(
            f"hydra.sweeper.direction={names}: each objective is minimize or maximize, e.g. "
            f"hydra.sweeper.direction=maximize or hydra.sweeper.direction=[minimize,maximize]."
        )
    return names


def open_study(
    storage: str | None,
    study_name: str | None,
    directions: list[str],
    sampler: DictConfig,
    pruner: DictConfig,
    grid: dict[str, list[Any]] | None = None,
    heartbeat_interval: int | None = None,
) -> optuna.Study:
    """The study `study_name` in `storage`, created when it does not exist yet.

    `storage` is a URL (src/utils/optuna_storage.py), or None for a study in memory. The trials
    a killed launch left running are marked failed: on this machine, those whose process is
    gone; on any, with `heartbeat_interval` (seconds) and a database, those whose heartbeat
    stopped (src/run/search/heartbeat.py). A seeded sampler is seeded at this launch's first
    trial (src/run/search/seeding.py). `grid` is the search space of a partial sampler (the grid
    sampler's).
    """
    study = optuna.create_study(
        storage=None if storage is None else open_storage(storage, heartbeat_interval),
        study_name=study_name,
        directions=cast(list[Literal["minimize", "maximize"]], directions),
        pruner=instantiate(pruner),
        load_if_exists=True,
    )
    created = [direction.name.lower() for direction in study.directions]
    if created != directions:
        raise ConfigError(
            f"hydra.sweeper.direction={directions}, but the study {study_name!r} in "
            f"{shown(storage)} was created to {created}: keep its direction or choose another "
            f"hydra.sweeper.study_name."
        )
    fail_orphaned_trials(study)
    study.sampler = build_sampler(sampler, grid)
    return study


def build_sampler(config: DictConfig, grid: dict[str, list[Any]] | None) -> BaseSampler:
    """The sampler `config` names, seeded at the launch's first trial when it has a seed."""

    def build(seed: int | None) -> BaseSampler:
        built = instantiate(config, **({} if seed is None else {"seed": seed}))
        return built(grid) if isinstance(built, functools.partial) else built

    seed = config.get("seed")
    return build(None) if seed is None else SeededAtFirstTrial(build, seed)


def ask(study: optuna.Study, distributions: dict, n_trials: int) -> optuna.Trial | None:
    """A new trial of `study`, recording which process on which machine asked it.

    None once the study holds `n_trials` trials, whichever launches asked them. Two launches
    that ask for the last one at the same moment both get a trial, numbered one after the other
    by the storage: the one numbered `n_trials` or more is marked failed at once and never runs.
    """
    if len(study.get_trials(deepcopy=False)) >= n_trials:
        return None
    trial = study.ask(distributions)
    trial.set_user_attr(ASKED_BY, {"host": socket.gethostname(), "pid": os.getpid()})
    if trial.number < n_trials:
        return trial
    fail(
        study,
        trial,
        f"not run: another launch asked for the last of the study's "
        f"hydra.sweeper.n_trials={n_trials} trials at the same moment",
    )
    return None


def fail_orphaned_trials(study: optuna.Study) -> list[int]:
    """Mark failed the trials that a killed launch left RUNNING; their numbers.

    On this machine, those whose process is gone; on any, those whose heartbeat stopped, when
    the storage keeps heartbeats. Any other is left alone: another launch sharing the study may
    be running it.
    """
    orphans = fail_stale_trials(study)
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = trial.user_attrs.get(ASKED_BY) or {}
        if owner.get("host") == socket.gethostname() and not is_alive(str(owner.get("pid"))):
            study.tell(trial.number, state=TrialState.FAIL)
            orphans.append(trial.number)
    if orphans:
        log.warning(
            "Trials %s of study %r were left running by a launch that was stopped (its process "
            "is gone, or its heartbeat): marked failed.",
            ", ".join(map(str, orphans)),
            study.study_name,
        )
    return orphans


def tell(study: optuna.Study, trial: optuna.Trial, job: JobReturn) -> FrozenTrial:
    """Record how the trial's job ended: pruned, failed, or complete with its values.

    Pruned: its pruning callback stopped it. Failed: it raised (the job recorded its error), its
    process died, or it returned no number (or not one per objective). A failed trial keeps why
    in its `fail_reason` user attribute.
    """
    if job.status == JobStatus.FAILED:  # a process that ended without a return: killed, say
        return fail(study, trial, one_line(job._return_value))
    if PRUNED_AT_STEP in stored_trial(study, trial.number).user_attrs:
        return record(study, trial, state=TrialState.PRUNED)
    try:
        values = objective_values(job.return_value, len(study.directions))
    except ValueError as problem:
        error = read_job_error(Path(job.working_dir)) if job.working_dir else None
        return fail(study, trial, error or str(problem))
    return record(study, trial, values=values)


def objective_values(returned: Any, objectives: int) -> list[float]:
    """The values a job returned, as numbers: one, or one per objective."""
    if returned is None:
        raise ValueError("its run returned no value (no metric named by `optimized_metric`)")
    wanted = "a number" if objectives == 1 else f"{objectives} numbers, one per objective"
    try:
        values = [float(returned)] if objectives == 1 else [float(value) for value in returned]
    except (TypeError, ValueError):
        raise ValueError(f"its run returned {returned!r}, not {wanted}") from None
    if len(values) != objectives or any(math.isnan(value) for value in values):
        raise ValueError(f"its run returned {returned!r}, not {wanted}")
    return values


def fail(study: optuna.Study, trial: optuna.Trial, reason: str) -> FrozenTrial:
    log.warning("Trial %d failed: %s", trial.number, reason)
    trial.set_user_attr(FAIL_REASON, reason)
    return record(study, trial, state=TrialState.FAIL)


def record(study: optuna.Study, trial: optuna.Trial, **outcome: Any) -> FrozenTrial:
    """`study.tell`, past the grid sampler's `study.stop()` once every point of its grid ran.

    That stop ends `study.optimize`'s loop, which an ask-and-tell search does not run: Optuna
    refuses it outside that loop, after it has stored the trial.
    """
    try:
        return study.tell(trial, **outcome)
    except RuntimeError as error:
        if "Study.stop" not in str(error):
            raise
        return stored_trial(study, trial.number)


def stored_trial(study: optuna.Study, number: int) -> FrozenTrial:
    """The trial as the storage holds it now, with what its job wrote there."""
    return next(trial for trial in study.get_trials(deepcopy=False) if trial.number == number)
