"""Two launches of the same search share one study, as two nodes of a cluster would: through a
PostgreSQL server (a throwaway one, conftest.py) or Optuna's journal file on a shared
filesystem. Together they run n_trials trials, each once, and killing one loses none of the
other's."""

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
from omegaconf import OmegaConf
from optuna.trial import TrialState

from src.run.search.study import ASKED_BY, open_study
from tests.run.storage.launches import launch, trials, wait_for_trials, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(params=["postgresql", "journal"])
def storage(request, tmp_path) -> str:
    """The URL of a new study storage that launches on several machines could share."""
    if request.param == "postgresql":
        return request.getfixturevalue("postgres_url")
    return f"journal:///{tmp_path}/study/optuna.log"  # an absolute path: journal:////tmp/...


def pids(ran) -> set[int]:
    """The processes, the launches, that asked the trials."""
    return {trial.user_attrs[ASKED_BY]["pid"] for trial in ran}


def asked(ran) -> bool:
    """Whether there are trials, each with the launch that asked it recorded (just after)."""
    return bool(ran) and all(ASKED_BY in trial.user_attrs for trial in ran)


def test_two_launches_run_n_trials_in_all_each_once_and_see_each_others(storage, tmp_path):
    sweep_dir = tmp_path / "sweep"  # one for both, as on a shared filesystem
    with ThreadPoolExecutor(2) as pool:
        launches = [launch(pool, sweep_dir, storage, 4, *wait_for_trials(2)) for _ in "ab"]
        results = [future.result() for future in launches]

    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    ran = trials(storage)
    assert [trial.number for trial in ran] == [0, 1, 2, 3], "the launches ran more than 4"
    assert [trial.state for trial in ran] == [TrialState.COMPLETE] * 4
    assert len(pids(ran)) == 2, "one launch ran every trial"
    drawn = {tuple(sorted(trial.params.items())) for trial in ran}
    assert len(drawn) == 4, f"the launches ran the same values twice: {drawn}"
    # Each trial ran once, in the job named after it, with the trial's values.
    assert sorted(path.name for path in sweep_dir.glob("[0-9]*")) == ["0", "1", "2", "3"]
    for trial in ran:
        overrides = OmegaConf.load(sweep_dir / str(trial.number) / ".hydra" / "overrides.yaml")
        assert f"optimizer.lr={trial.params['optimizer.lr']}" in overrides
    # The launch that ended last read the other's trials: its summary and best trial hold all.
    summary = (sweep_dir / "summary.md").read_text()
    assert summary.count("| COMPLETE |") == 4, summary
    best = OmegaConf.load(sweep_dir / "optimization_results.yaml")
    assert best.best_value == max(trial.values[0] for trial in ran)


def test_killing_one_launch_loses_none_of_the_others_trials(storage, tmp_path):
    sweep_dir = tmp_path / "sweep"
    with ThreadPoolExecutor(2) as pool:
        # The first launch's trial waits for a count no search reaches: it runs until killed.
        killed = launch(pool, sweep_dir, storage, 3, *wait_for_trials(99, timeout_s=60))
        wait_until(lambda: asked(trials(storage)), "the first launch's trial")
        (victim,) = pids(trials(storage))
        survivor = launch(pool, sweep_dir, storage, 3, *wait_for_trials(2))
        wait_until(lambda: len(trials(storage)) == 2, "the second launch's first trial")
        os.killpg(victim, signal.SIGKILL)  # the launch, and any process of its trials
        results = killed.result(), survivor.result()

    assert results[0].returncode == -signal.SIGKILL, results[0].stderr[-3000:]
    assert results[1].returncode == 0, results[1].stderr[-3000:]
    left, *survived = trials(storage)
    assert left.state == TrialState.RUNNING, "the killed launch's trial is not running any more"
    assert [trial.state for trial in survived] == [TrialState.COMPLETE] * 2
    assert victim not in pids(survived), "the killed launch asked a second trial"
    for trial in survived:
        assert (sweep_dir / str(trial.number) / "metrics.json").is_file()

    # A search that resumes the study on this machine marks the killed launch's trial failed.
    sampler = OmegaConf.create({"_target_": "optuna.samplers.RandomSampler", "seed": 0})
    pruner = OmegaConf.create({"_target_": "optuna.pruners.NopPruner"})
    resumed = open_study(storage, "search", ["maximize"], sampler, pruner)
    states = [trial.state for trial in resumed.trials]
    assert states == [TrialState.FAIL, TrialState.COMPLETE, TrialState.COMPLETE]
