"""Searches launched at once on one study, as the nodes of a cluster launch them."""

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import optuna
from lightning.pytorch import Callback

from src.utils.optuna_storage import open_storage
from tests.helpers import FAST, run_train


class WaitForTrials(Callback):
    """Holds each trial's run at its start until the study holds `count` trials.

    With a count of 2, two launches each run a trial before either ends one, so neither finds
    the study done before it takes part; with a count no search reaches, the trial waits until
    its launch is killed (or `timeout_s` passes).
    """

    def __init__(self, storage: str, study_name: str, count: int, timeout_s: float = 120.0):
        self.storage = storage
        self.study_name = study_name
        self.count = count
        self.timeout_s = timeout_s

    def on_fit_start(self, trainer, pl_module):
        study = optuna.load_study(study_name=self.study_name, storage=open_storage(self.storage))
        deadline = time.monotonic() + self.timeout_s
        while len(study.get_trials(deepcopy=False)) < self.count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the study never held {self.count} trials")
            time.sleep(0.1)


def wait_for_trials(count: int, timeout_s: float = 120.0) -> list[str]:
    """The overrides that add WaitForTrials, for `count` trials, to every trial's run."""
    return [
        f"+callbacks.wait_for_trials._target_={__name__}.WaitForTrials",
        "+callbacks.wait_for_trials.storage=${hydra:sweeper.storage}",
        "+callbacks.wait_for_trials.study_name=${hydra:sweeper.study_name}",
        f"+callbacks.wait_for_trials.count={count}",
        f"+callbacks.wait_for_trials.timeout_s={timeout_s}",
    ]


def launch(
    pool: ThreadPoolExecutor, sweep_dir: Path, storage: str, n_trials: int, *overrides: str
) -> Future:
    """`python train.py hparams_search=optuna ...` in a process of its own, started now: a search
    of small digits runs on the study `search` in `storage`; the future of its result."""
    args = [
        "hparams_search=optuna",
        f"hydra.sweep.dir={sweep_dir}",
        f"hydra.sweeper.storage='{storage}'",  # quoted: a URL's query holds a `=`
        f"hydra.sweeper.n_trials={n_trials}",
        *FAST,
        "trainer.limit_train_batches=4",
        "trainer.limit_val_batches=2",
        "test=false",
        *overrides,
    ]
    return pool.submit(run_train, args, check=False, timeout=180)


def trials(storage: str) -> list[optuna.trial.FrozenTrial]:
    """The trials of the study `search` in `storage`; none before a launch created it."""
    try:
        study = optuna.load_study(study_name="search", storage=open_storage(storage))
    except KeyError:  # Optuna's "Record does not exist."
        return []
    return study.trials


def wait_until(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.1)
