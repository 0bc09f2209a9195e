"""Heartbeats of the trials a launch runs, so that other launches sharing the study see it die.

A trial left RUNNING by a launch killed on another machine cannot be told from one still
running there by its process id. With `hydra.sweeper.heartbeat_interval` and a database storage
(Optuna keeps heartbeats in RDBStorage only, not in its journal file), the sweeper records a
heartbeat for each trial of the batch it runs, every interval, from a thread; before asking for
trials, every launch marks failed the RUNNING trials whose last heartbeat is older than the grace
period (Optuna's `fail_stale_trials`).

Optuna records heartbeats itself only inside `study.optimize`, which runs trials in its own
process; here the trials run in the launcher's jobs while the sweeper waits, so the sweeper
beats for them.
"""

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import optuna
from optuna.storages import BaseStorage
from optuna.trial import TrialState

RUNNING, FAIL = TrialState.RUNNING, TrialState.FAIL


def beats(storage: BaseStorage) -> bool:
    """Whether `storage` keeps heartbeats (a database's) and was opened with an interval."""
    return getattr(storage, "get_heartbeat_interval", lambda: None)() is not None


@contextmanager
def heartbeats(study: optuna.Study, trials: Sequence[optuna.Trial]) -> Iterator[None]:
    """Record a heartbeat for each of `trials` now and every interval while inside."""
    storage: Any = study._storage  # a database's: it keeps heartbeats
    if not beats(storage):
        yield
        return
    interval = storage.get_heartbeat_interval()
    # A Trial's storage id (its number counts within the study only).
    ids = [trial._trial_id for trial in trials]
    stop = threading.Event()

    def beat() -> None:
        while True:
            for trial_id in ids:
                storage.record_heartbeat(trial_id)
            if stop.wait(interval):
                return

    thread = threading.Thread(target=beat, name="optuna-heartbeats", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def fail_stale_trials(study: optuna.Study) -> list[int]:
    """Mark failed the RUNNING trials whose heartbeat stopped; their numbers."""
    if not beats(study._storage):
        return []
    running = {trial.number for trial in study.get_trials(deepcopy=False, states=(RUNNING,))}
    optuna.storages.fail_stale_trials(study)
    return [trial.number for trial in study.get_trials(deepcopy=False, states=(FAIL,))
            if trial.number in running]  # fmt: skip
