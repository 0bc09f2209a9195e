"""The Optuna search (hparams_search=optuna): Hydra's sweep syntax as Optuna distributions, the
study that resumes with a sampler that goes on, and whole searches whose trials are pruned,
fail or run in parallel."""

import functools
import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import optuna
import pytest
import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.utils import instantiate
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from hydra_plugins.optuna_ask_tell.config import PRUNERS, SAMPLERS
from hydra_plugins.optuna_ask_tell.sweeper import batch_sizes, consecutive_runs
from src.callbacks.training.optuna_pruning import PRUNED_AT_STEP
from src.run.search.processes import gpu_slots, run_in_processes
from src.run.search.space import search_space, trial_overrides
from src.run.search.study import ASKED_BY, ask, open_study, tell
from src.utils.errors import ConfigError
from tests.helpers import FAST, run_train

optuna.logging.set_verbosity(optuna.logging.WARNING)


# -- Hydra's sweep syntax -----------------------------------------------------------------------


def hydra_values(sweep: str) -> list:
    """The values Hydra's basic sweeper runs for `key=<sweep>`."""
    (override,) = OverridesParser.create().parse_overrides([f"key={sweep}"])
    return list(override.sweep_iterator())


def grid(distribution) -> list:
    """Every value of a stepped distribution, low to high."""
    count = round((distribution.high - distribution.low) / distribution.step) + 1
    return [distribution.low + index * distribution.step for index in range(count)]


@pytest.mark.parametrize(
    ("sweep", "expected"),
    [
        ("tag(log, interval(1e-4, 1e-2))", FloatDistribution(1e-4, 1e-2, log=True)),
        ("interval(0, 0.5)", FloatDistribution(0.0, 0.5)),
        ("tag(int, interval(8, 64))", IntDistribution(8, 64)),
        ("tag(log, int, interval(1, 1024))", IntDistribution(1, 1024, log=True)),
        ("choice(32, 64, 128)", CategoricalDistribution([32, 64, 128])),
        ("choice(adam, sgd)", CategoricalDistribution(["adam", "sgd"])),
        ("range(1, 10, 3)", IntDistribution(1, 7, step=3)),
        ("tag(log, range(1, 100))", IntDistribution(1, 99, log=True)),
    ],
)
def test_each_sweep_becomes_the_optuna_distribution_of_the_same_values(sweep, expected):
    distributions, fixed = search_space({"key": sweep}, [])
    assert distributions == {"key": expected}, f"{sweep} became {distributions['key']}"
    assert fixed == []


@pytest.mark.parametrize("sweep", ["range(1, 10, 3)", "range(0, 12, 4)", "range(0.1, 0.5, 0.1)"])
def test_a_range_covers_exactly_the_values_hydras_basic_sweeper_runs(sweep):
    (distribution,) = search_space({"key": sweep}, [])[0].values()
    assert grid(distribution) == pytest.approx(hydra_values(sweep)), f"{sweep}: {distribution}"


def test_fixed_values_go_to_every_trial_and_the_command_line_wins_over_params():
    params = {"optimizer.lr": "tag(log, interval(1e-4, 1e-2))", "data.batch_size": "choice(32, 64)"}
    arguments = ["data.batch_size=64", "model=cnn", "optimizer.weight_decay=interval(0, 0.1)"]

    distributions, fixed = search_space(params, arguments)

    assert set(distributions) == {"optimizer.lr", "optimizer.weight_decay"}
    assert fixed == ["data.batch_size=64", "model=cnn"]


@pytest.mark.parametrize(
    "sweep",
    ["shuffle(range(1, 4))", "tag(grid, choice(1, 2))", "choice([1, 2], [3])", "range(5, 1)"],
)
def test_a_sweep_optuna_cannot_sample_is_refused_with_the_override_named(sweep):
    with pytest.raises(ConfigError, match="key="):
        search_space({"key": sweep}, [])


@pytest.mark.parametrize(
    ("sweep", "words"),
    [
        ("interval(0.1, 0.01)", "low bound 0.1 is above its high bound 0.01; swap them"),
        ("tag(int, interval(8, 2))", "low bound 8.0 is above its high bound 2.0"),
        ("tag(log, interval(0, 0.1))", "log-scaled range needs bounds above 0"),
        ("tag(log, interval(-1e-3, 0.1))", "its low bound is -0.001"),
        ("tag(log, range(0, 5))", "log-scaled range needs bounds above 0"),
    ],
)
def test_bounds_optuna_cannot_sample_are_refused_before_optuna_sees_them(sweep, words):
    with pytest.raises(ConfigError, match="key=") as error:
        search_space({"key": sweep}, [])
    assert words in str(error.value)


def test_sampled_values_come_back_from_their_overrides_unchanged():
    params = {"model": "cnn", "trainer.precision": "16-mixed", "tags": "a, b (c)", "lr": 3e-4}
    overrides = OverridesParser.create().parse_overrides(trial_overrides(params))
    assert {o.key_or_group: o.value() for o in overrides} == params


# -- the study ----------------------------------------------------------------------------------


def random_sampler(seed):
    return OmegaConf.create({"_target_": "optuna.samplers.RandomSampler", "seed": seed})


NO_PRUNER = OmegaConf.create({"_target_": "optuna.pruners.NopPruner"})
SPACE = {"x": FloatDistribution(0, 1)}


def first_values(storage, count, seed=0):
    study = open_study(storage, "search", "minimize", random_sampler(seed), NO_PRUNER)
    values = []
    for _ in range(count):
        trial = study.ask(SPACE)
        study.tell(trial, trial.params["x"])
        values.append(trial.params["x"])
    return values


def test_a_resumed_study_draws_new_values_and_the_same_ones_for_the_same_history(tmp_path):
    first = first_values(f"sqlite:///{tmp_path}/a.db", 2)
    resumed = first_values(f"sqlite:///{tmp_path}/a.db", 2)
    again = first_values(f"sqlite:///{tmp_path}/b.db", 2) + first_values(
        f"sqlite:///{tmp_path}/b.db", 2
    )

    assert not set(resumed) & set(first), f"the resumed study repeats {first}"
    assert again == first + resumed, "the same commands on a new study drew other values"


def test_a_study_resumed_in_the_other_direction_is_refused(tmp_path):
    storage = f"sqlite:///{tmp_path}/nested/study.db"  # the folder is created
    open_study(storage, "search", "minimize", random_sampler(0), NO_PRUNER)
    with pytest.raises(ConfigError, match="direction=maximize"):
        open_study(storage, "search", "maximize", random_sampler(0), NO_PRUNER)


def job_return(value=None, error=None) -> JobReturn:
    job = JobReturn()
    job.status = JobStatus.FAILED if error else JobStatus.COMPLETED
    job.return_value = error or value
    return job


@pytest.mark.filterwarnings("ignore:The value nan is not acceptable")
def test_each_trial_is_told_how_its_job_ended(tmp_path):
    study = open_study(
        f"sqlite:///{tmp_path}/s.db", "search", "minimize", random_sampler(0), NO_PRUNER
    )
    trials = [study.ask(SPACE) for _ in range(5)]
    trials[1].set_user_attr(PRUNED_AT_STEP, 2)  # as its pruning callback marks it
    jobs = [
        job_return(0.5),
        job_return(0.9),
        job_return(error=ValueError("bad input")),
        job_return(None),  # the run logged no optimized_metric
        job_return(float("nan")),
    ]
    states = [tell(study, trial, job).state for trial, job in zip(trials, jobs, strict=True)]

    assert states == [TrialState.COMPLETE, TrialState.PRUNED] + [TrialState.FAIL] * 3
    assert study.trials[0].value == 0.5


def test_a_resumed_study_fails_the_trials_a_killed_sweep_left_running_and_no_others(tmp_path):
    storage = f"sqlite:///{tmp_path}/s.db"
    study = open_study(storage, "search", "minimize", random_sampler(0), NO_PRUNER)
    killed = subprocess.Popen([sys.executable, "-c", "pass"])
    killed.wait()  # a sweep process that is gone
    owners = {
        "killed here": {"host": socket.gethostname(), "pid": killed.pid},
        "alive here": {"host": socket.gethostname(), "pid": os.getpid()},
        "on another machine": {"host": "node-17", "pid": killed.pid},
    }
    for owner in owners.values():
        study.ask(SPACE).set_user_attr(ASKED_BY, owner)
    asked = ask(study, SPACE)
    assert asked.user_attrs[ASKED_BY] == owners["alive here"]

    resumed = open_study(storage, "search", "minimize", random_sampler(0), NO_PRUNER)
    states = [trial.state for trial in resumed.trials]
    assert states == [TrialState.FAIL, *[TrialState.RUNNING] * 3]


@pytest.mark.parametrize(("name", "node"), [*SAMPLERS.items(), *PRUNERS.items()])
def test_every_sampler_and_pruner_option_builds(name, node):
    built = instantiate(node)
    assert isinstance(built, optuna.samplers.BaseSampler | optuna.pruners.BasePruner), name


# -- the sweeper's batches and the launcher's GPUs ----------------------------------------------


def test_trials_are_asked_in_batches_of_n_jobs():
    assert batch_sizes(5, 2) == [2, 2, 1]
    assert batch_sizes(3, 1) == [1, 1, 1]


def test_trials_whose_numbers_another_process_took_between_are_launched_apart():
    trials = [SimpleNamespace(number=n) for n in (4, 5, 7, 8, 10)]
    runs = consecutive_runs(trials)
    assert [[trial.number for trial in run] for run in runs] == [[4, 5], [7, 8], [10]]


def test_a_job_whose_process_dies_fails_alone():
    # Calls of the standard library: a child process imports nothing of the tests to run them.
    calls = [os.getpid, functools.partial(os._exit, 3), functools.partial(int, "x")]
    pid, died, raised = run_in_processes(calls)

    assert isinstance(pid, int), "the call ran in this process"
    assert pid != os.getpid(), "the call ran in this process"
    assert isinstance(died, ChildProcessError), died
    assert "code 3" in str(died), died
    assert isinstance(raised, ValueError), raised
    assert "'x'" in str(raised), raised


def test_each_parallel_job_sees_one_gpu_of_this_process_round_robin(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,9")
    seen = run_in_processes([functools.partial(os.getenv, "CUDA_VISIBLE_DEVICES")] * 3)
    assert seen == ["7", "9", "7"]


def test_without_gpus_parallel_jobs_leave_cuda_visible_devices_alone():
    assert gpu_slots(2, []) == [None, None]


# -- whole searches -----------------------------------------------------------------------------


def search(sweep_dir, *overrides: str, storage=None, check=True) -> optuna.Study:
    """`python train.py hparams_search=optuna <overrides>` in `sweep_dir`; its study.

    With `check`, the search must exit 0; without, its result is kept in `search.result`."""
    storage = storage or f"sqlite:///{sweep_dir}/optuna.db"
    search.result = run_train(
        [
            "hparams_search=optuna",
            f"hydra.sweep.dir={sweep_dir}",
            f"hydra.sweeper.storage={storage}",
            *FAST,
            *overrides,
        ],
        check=check,
    )
    return optuna.load_study(study_name="search", storage=storage)


@pytest.mark.slow
def test_a_search_resumes_its_study_for_n_trials_more_without_repeating_trials(tmp_path):
    storage = f"sqlite:///{tmp_path}/study.db"
    no_pruning = "hydra/sweeper/pruner=none"
    search(tmp_path / "first", "hydra.sweeper.n_trials=4", no_pruning, storage=storage)
    study = search(tmp_path / "resumed", "hydra.sweeper.n_trials=2", no_pruning, storage=storage)

    assert [trial.number for trial in study.trials] == list(range(6))
    assert [trial.state for trial in study.trials] == [TrialState.COMPLETE] * 6
    first, resumed = study.trials[:4], study.trials[4:]
    repeated = [t.params for t in resumed if t.params in [f.params for f in first]]
    assert not repeated, f"the resumed search ran the first search's trials again: {repeated}"
    # Jobs are named after their trials, so a resumed search never overwrites a trial's run.
    assert sorted(path.name for path in (tmp_path / "resumed").glob("[0-9]*")) == ["4", "5"]
    best = OmegaConf.load(tmp_path / "resumed" / "optimization_results.yaml")
    assert best.best_trial == study.best_trial.number, "the results file ignores the first run"
    assert "## Parameter importance" in (tmp_path / "resumed" / "summary.md").read_text()


# A threshold no accuracy reaches: the pruner gives up on a trial at its first report.
PRUNE_AT_ONCE = [
    "hydra/sweeper/pruner=none",
    "hydra.sweeper.pruner._target_=optuna.pruners.ThresholdPruner",
    "+hydra.sweeper.pruner.lower=2.0",
    "hydra.sweeper.n_trials=1",
    "trainer.max_epochs=3",
]


def assert_pruned_after_one_epoch(study: optuna.Study, sweep_dir) -> None:
    (trial,) = study.trials
    assert trial.state == TrialState.PRUNED
    assert list(trial.intermediate_values) == [0], "the trial reported after it was pruned"
    last = torch.load(sweep_dir / "0" / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["epoch"] == 0, f"the run trained on to epoch {last['epoch']} of 3"


@pytest.mark.slow
def test_a_pruned_trial_stops_early_and_is_recorded_as_pruned(tmp_path):
    study = search(tmp_path, *PRUNE_AT_ONCE)

    assert_pruned_after_one_epoch(study, tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    assert "| PRUNED |" in summary, summary


@pytest.mark.slow
def test_every_rank_of_a_ddp_trial_stops_when_it_is_pruned(tmp_path):
    # Had rank 1 trained on alone, it would wait for rank 0 in its next all-reduce: no exit.
    study = search(tmp_path, *PRUNE_AT_ONCE, "trainer=ddp_cpu", "trainer.strategy=ddp_spawn")

    assert_pruned_after_one_epoch(study, tmp_path)


@pytest.mark.slow
def test_a_failed_trial_is_recorded_as_failed_and_the_search_goes_on(tmp_path):
    # Jobs are numbered after their trials: trial 0 gets a batch size of 0, which fails.
    study = search(
        tmp_path,
        "hydra.sweeper.n_trials=2",
        "data.batch_size=${hydra:job.num}",
        "trainer.limit_train_batches=4",
        "trainer.limit_val_batches=4",
        check=False,
    )

    assert [trial.state for trial in study.trials] == [TrialState.FAIL, TrialState.COMPLETE]
    assert (tmp_path / "1" / "metrics.json").is_file(), "the trial after the failure did not run"
    result = search.result
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    failure = "Job 0 failed: data.batch_size must be a positive"
    assert failure in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("Error: 1 of 2 jobs of the sweep")
    summary = (tmp_path / "summary.md").read_text()
    assert "| failed: data.batch_size must be a positive integer, got 0" in summary, summary


@pytest.mark.slow
def test_n_jobs_trials_run_at_once(tmp_path):
    study = search(tmp_path, "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=2")

    assert [trial.state for trial in study.trials] == [TrialState.COMPLETE] * 2
    # A job's .hydra/ is written when it starts and its metrics.json when it ends.
    started = [(tmp_path / job / ".hydra" / "config.yaml").stat().st_mtime for job in "01"]
    ended = [(tmp_path / job / "metrics.json").stat().st_mtime for job in "01"]
    assert max(started) < min(ended), f"one trial ended before the other started: {started} {ended}"
    values = [json.loads((tmp_path / job / "metrics.json").read_text()) for job in "01"]
    assert [v["metrics"]["val/acc_best"] for v in values] == [t.value for t in study.trials]
