"""Trials' heartbeats (src/run/search/heartbeat.py): a launch killed on another machine leaves
trials RUNNING whose heartbeat stops; the next launch to open the study marks them failed, and
leaves alone those whose launch still beats for them. SQLite stands for any database here
(tests/run/storage runs the launches themselves on PostgreSQL)."""

import socket
import time

import pytest
from omegaconf import OmegaConf
from optuna.trial import TrialState

from hydra_plugins.optuna_ask_tell.sweeper import check_counts
from src.run.search.heartbeat import heartbeats
from src.run.search.study import ASKED_BY, open_study
from src.utils.errors import ConfigError

SAMPLER = OmegaConf.create({"_target_": "optuna.samplers.RandomSampler", "seed": 0})
PRUNER = OmegaConf.create({"_target_": "optuna.pruners.NopPruner"})
INTERVAL = 1  # second; a trial is stale after 2 without a heartbeat


def open_(storage: str, heartbeat_interval: int | None = INTERVAL):
    return open_study(storage, "search", ["minimize"], SAMPLER, PRUNER, None, heartbeat_interval)


def asked_elsewhere(study):
    """A trial asked by a launch on another machine, which this one cannot see die."""
    trial = study.ask()
    trial.set_user_attr(ASKED_BY, {"host": f"not-{socket.gethostname()}", "pid": 1})
    return trial


@pytest.mark.slow
def test_a_trial_whose_heartbeat_stopped_is_failed_and_one_still_beating_is_not(tmp_path, caplog):
    storage = f"sqlite:///{tmp_path}/optuna.db"
    study = open_(storage)
    dead, alive = asked_elsewhere(study), asked_elsewhere(study)
    with heartbeats(study, [dead]):
        pass  # one heartbeat, then the launch is killed
    with heartbeats(study, [alive]):
        # Past the grace period however SQLite's whole-second clock rounds the first beat.
        time.sleep(2 * INTERVAL + 1.5)
        resumed = open_(storage)
    states = {trial.number: trial.state for trial in resumed.trials}
    assert states == {dead.number: TrialState.FAIL, alive.number: TrialState.RUNNING}
    assert f"Trials {dead.number} of study 'search' were left running" in caplog.text


def test_without_heartbeats_a_trial_of_another_machine_is_left_running(tmp_path):
    """It may still be running there: only its launch's heartbeat could say it is not."""
    for storage in (f"sqlite:///{tmp_path}/optuna.db", f"journal:///{tmp_path}/optuna.log"):
        study = open_(storage, heartbeat_interval=None)
        trial = asked_elsewhere(study)
        with heartbeats(study, [trial]):  # records nothing
            pass
        time.sleep(0.1)
        assert open_(storage, heartbeat_interval=None).trials[0].state == TrialState.RUNNING


@pytest.mark.parametrize(
    ("n_jobs", "interval", "message"),
    [(0, 60, r"n_jobs=0: .* 1 or more"), (1, 0, r"heartbeat_interval=0: give the seconds")],
)
def test_counts_below_one_are_refused(n_jobs, interval, message):
    with pytest.raises(ConfigError, match=message):
        check_counts(n_jobs, interval)
