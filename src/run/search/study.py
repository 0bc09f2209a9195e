"""Keep the Optuna study of a hyperparameter search.

It is opened or resumed with a seeded sampler, told how each trial's job ended, and read back
for the results file and the sweep summary.
"""

import logging
import os
import socket
from pathlib import Path
from typing import Literal, cast

import optuna
from hydra.core.utils import JobReturn, JobStatus
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy.engine import make_url

from src.callbacks.training.optuna_pruning import PRUNED_AT_STEP
from src.utils.error_boundary import one_line, read_job_error
from src.utils.errors import ConfigError
from src.utils.files import is_alive

log = logging.getLogger(__name__)

# With fewer complete trials, the importance of each parameter is mostly noise.
MIN_TRIALS_FOR_IMPORTANCE = 4
# The user attribute naming the process that asked a trial, {"host": ..., "pid": ...}: a resumed
# search tells a trial left RUNNING by a killed sweep from one another launch is running now.
ASKED_BY = "asked_by"


def open_study(
    storage: str | None, study_name: str, direction: str, sampler: DictConfig, pruner: DictConfig
) -> optuna.Study:
    """The study `study_name` in `storage`, created when it does not exist yet.

    The sampler's seed is offset by the number of trials the study already holds: a resumed
    search draws new values instead of repeating the first run's, and the same command on the
    same study still draws the same ones.
    """
    make_sqlite_folder(storage)
    study = optuna.create_study(
        storage=storage,
        study_name=study_name,
        # Any other string is refused by create_study itself, with its own message.
        direction=cast(Literal["minimize", "maximize"], direction),
        pruner=instantiate(pruner),
        load_if_exists=True,
    )
    if study.direction != StudyDirection[direction.upper()]:
        raise ConfigError(
            f"hydra.sweeper.direction={direction}, but the study {study_name!r} in {storage} "
            f"was created to {study.direction.name.lower()}: keep its direction or choose "
            f"another hydra.sweeper.study_name."
        )
    seed = sampler.get("seed")
    study.sampler = instantiate(
        sampler, **({} if seed is None else {"seed": seed + len(study.trials)})
    )
    fail_orphaned_trials(study)
    return study


def ask(study: optuna.Study, distributions: dict) -> optuna.Trial:
    """A new trial of `study`, recording which process on which machine asked it."""
    trial = study.ask(distributions)
    trial.set_user_attr(ASKED_BY, {"host": socket.gethostname(), "pid": os.getpid()})
    return trial


def fail_orphaned_trials(study: optuna.Study) -> list[int]:
    """Mark failed the trials that a sweep killed on this machine left RUNNING.

    Returns their numbers. A trial asked by a process still alive, or on another machine, is
    left alone: another launch sharing the study may be running it.
    """
    orphans = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = trial.user_attrs.get(ASKED_BY) or {}
        if owner.get("host") == socket.gethostname() and not is_alive(str(owner.get("pid"))):
            study.tell(trial.number, state=TrialState.FAIL)
            orphans.append(trial.number)
    if orphans:
        log.warning(
            "Trials %s of study %r were left running by a sweep that was stopped (its process "
            "is gone): marked failed.",
            ", ".join(map(str, orphans)),
            study.study_name,
        )
    return orphans


def make_sqlite_folder(storage: str | None) -> None:
    """SQLite creates a database file, not the folders above it."""
    if storage is None:
        return
    url = make_url(storage)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)


def tell(study: optuna.Study, trial: optuna.Trial, job: JobReturn) -> FrozenTrial:
    """Record how the trial's job ended: pruned, failed, or complete with its value.

    Pruned: its pruning callback stopped it. Failed: it raised (the job recorded its error), its
    process died, or it returned no number.
    """
    if job.status == JobStatus.FAILED:  # a process that ended without a return: killed, say
        log.warning("Trial %d failed: %s", trial.number, one_line(job._return_value))
        return study.tell(trial, state=TrialState.FAIL)
    if PRUNED_AT_STEP in stored_trial(study, trial.number).user_attrs:
        return study.tell(trial, state=TrialState.PRUNED)
    if job.return_value is None:
        error = read_job_error(Path(job.working_dir)) if job.working_dir else None
        log.warning(
            "Trial %d failed: %s",
            trial.number,
            error or "its run returned no value (no metric named by `optimized_metric`)",
        )
        return study.tell(trial, state=TrialState.FAIL)
    return study.tell(trial, float(job.return_value))  # Optuna records NaN as a failure


def stored_trial(study: optuna.Study, number: int) -> FrozenTrial:
    """The trial as the storage holds it now, with what its job wrote there."""
    return next(trial for trial in study.get_trials(deepcopy=False) if trial.number == number)


def write_results(study: optuna.Study, path: Path) -> None:
    """The best trial so far as `optimization_results.yaml`, as Hydra's Optuna sweeper wrote it."""
    try:
        best = study.best_trial
    except ValueError:
        log.warning("No trial of study %r completed: no %s written.", study.study_name, path.name)
        return
    results = {
        "name": "optuna",
        "study_name": study.study_name,
        "best_trial": best.number,
        "best_params": best.params,
        "best_value": best.value,
    }
    OmegaConf.save(results, path)
    log.info("Best trial %d: %s = %s (%s)", best.number, best.params, best.value, path)


def load_study_report(storage: str, study_name: str) -> tuple[dict[int, str], dict[str, float]]:
    """Read each trial's state by number and each parameter's importance.

    States are "COMPLETE", "PRUNED", "FAIL", ...; importances are empty below
    MIN_TRIALS_FOR_IMPORTANCE complete trials.
    """
    study = optuna.load_study(study_name=study_name, storage=storage)
    trials = study.get_trials(deepcopy=False)
    states = {trial.number: trial.state.name for trial in trials}
    complete = sum(trial.state == TrialState.COMPLETE for trial in trials)
    importances: dict[str, float] = {}
    if complete >= MIN_TRIALS_FOR_IMPORTANCE:
        importances = optuna.importance.get_param_importances(study)
    return states, importances
