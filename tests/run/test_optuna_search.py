"""The Optuna search (hparams_search=optuna): Hydra's sweep syntax as Optuna distributions, the
study that resumes with a sampler that goes on, several objectives and their Pareto front, and
whole searches whose trials are pruned, fail or run in parallel.

tests/run/upstream_optuna/ holds the tests of Hydra's own Optuna sweeper, run against this one.
"""

import functools
import json
import os
import socket
import subprocess
import sys
from enum import Enum
from types import SimpleNamespace

import optuna
import pytest
import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from hydra_plugins.optuna_ask_tell.config import PRUNERS, SAMPLERS
from hydra_plugins.optuna_ask_tell.sweeper import (
    TrialMaker,
    check_failure_rate,
    check_pruning,
    consecutive_runs,
    custom_function,
)
from src.callbacks.training.optuna_pruning import PRUNED_AT_STEP
from src.run.search.objective import optimized_value
from src.run.search.processes import gpu_slots, run_in_processes
from src.run.search.results import write_results
from src.run.search.space import grid_space, search_space, trial_overrides
from src.run.search.study import (
    ASKED_BY,
    FAIL_REASON,
    ask,
    open_study,
    study_directions,
    tell,
)
from src.utils.errors import ConfigError
from src.utils.optuna_storage import open_storage
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
        ("int(interval(8, 64))", IntDistribution(8, 64)),
        ("tag(int, interval(8, 64))", IntDistribution(8, 64)),
        ("tag(log, int(interval(1, 1024)))", IntDistribution(1, 1024, log=True)),
        ("tag(log, int, interval(1, 1024))", IntDistribution(1, 1024, log=True)),
        ("choice(32, 64, 128)", CategoricalDistribution([32, 64, 128])),
        ("choice(adam, sgd)", CategoricalDistribution(["adam", "sgd"])),
        ("range(1, 10, 3)", IntDistribution(1, 10, step=3)),
        ("range(0, 11, 4)", IntDistribution(0, 8, step=4)),  # the last value at or below stop
        ("range(0.5, 2.5, 0.5)", FloatDistribution(0.5, 2.5, step=0.5)),
        ("tag(log, range(1, 100))", IntDistribution(1, 100, log=True)),
        ("shuffle(range(1, 4))", CategoricalDistribution([1, 2, 3])),
    ],
)
def test_each_sweep_becomes_the_optuna_distribution_of_the_same_values(sweep, expected):
    distributions, fixed, deletions = search_space({"key": sweep}, [])
    assert distributions == {"key": expected}, f"{sweep} became {distributions['key']}"
    assert (fixed, deletions) == ({}, [])


@pytest.mark.parametrize("sweep", ["range(1, 10, 3)", "range(0, 12, 4)", "range(0.1, 0.5, 0.1)"])
def test_a_range_samples_up_to_its_stop_and_its_grid_is_what_hydras_basic_sweeper_runs(sweep):
    # As Hydra's Optuna sweeper: range() is Optuna's stepped distribution from start to stop,
    # and the grid sampler runs the values of Hydra's range, which stop is not one of.
    distributions = search_space({"key": sweep}, [])[0]
    stop = OverridesParser.create().parse_overrides([f"key={sweep}"])[0].value().stop

    assert grid(distributions["key"]) == pytest.approx([*hydra_values(sweep), stop])
    assert grid_space(distributions, [f"key={sweep}"])["key"] == hydra_values(sweep)


def test_a_grid_runs_every_integer_of_an_interval_and_refuses_a_float_one():
    arguments = ["a=int(interval(1, 3))", "b=choice(x, y)"]
    distributions = search_space({}, arguments)[0]
    assert grid_space(distributions, arguments) == {"a": [1, 2, 3], "b": ["x", "y"]}
    with pytest.raises(ConfigError, match="not a float interval"):
        grid_space(search_space({}, ["c=interval(0, 1)"])[0], ["c=interval(0, 1)"])


def test_fixed_values_and_deletions_go_to_every_trial_and_the_command_line_wins_over_params():
    params = {"optimizer.lr": "tag(log, interval(1e-4, 1e-2))", "data.batch_size": "choice(32, 64)"}
    arguments = [
        "data.batch_size=64",
        "model=cnn",
        "optimizer.weight_decay=interval(0, 0.1)",
        "~callbacks.plots",
    ]

    distributions, fixed, deletions = search_space(params, arguments)

    assert set(distributions) == {"optimizer.lr", "optimizer.weight_decay"}
    assert fixed == {"data.batch_size": "64", "model": "cnn"}
    assert deletions == ["~callbacks.plots"]
    assert trial_overrides({"optimizer.lr": 0.01}, fixed, deletions) == [
        "optimizer.lr=0.01",
        "data.batch_size=64",
        "model=cnn",
        "~callbacks.plots",
    ]


def test_the_old_search_space_counts_only_without_params_and_warns_either_way():
    legacy = {
        "x": {"type": "float", "low": -5.5, "high": 5.5, "step": 0.5},
        "n": {"type": "int", "low": 1, "high": 100, "log": True},
        "c": {"type": "categorical", "choices": [1, 2]},
    }
    with pytest.warns(UserWarning, match="search_space is deprecated"):
        distributions = search_space(None, ["c=3"], legacy)[0]
    assert distributions == {
        "x": FloatDistribution(-5.5, 5.5, step=0.5),
        "n": IntDistribution(1, 100, log=True),
    }, "a fixed value on the command line wins over the old search space"

    with pytest.warns(UserWarning, match="uses params and ignores search_space"):
        distributions = search_space({"y": "choice(1, 2)"}, [], legacy)[0]
    assert list(distributions) == ["y"]


@pytest.mark.parametrize(
    "sweep",
    ["tag(grid, choice(1, 2))", "choice([1, 2], [3])", "range(5, 1)", "range(1, 5, -1)", "glob(*)"],
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
    overrides = OverridesParser.create().parse_overrides(trial_overrides(params, {}, []))
    assert {o.key_or_group: o.value() for o in overrides} == params


# -- the study ----------------------------------------------------------------------------------


def random_sampler(seed):
    return OmegaConf.create({"_target_": "optuna.samplers.RandomSampler", "seed": seed})


NO_PRUNER = OmegaConf.create({"_target_": "optuna.pruners.NopPruner"})
SPACE = {"x": FloatDistribution(0, 1)}


def first_values(storage, count, seed=0):
    study = open_study(storage, "search", ["minimize"], random_sampler(seed), NO_PRUNER)
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
    open_study(storage, "search", ["minimize"], random_sampler(0), NO_PRUNER)
    with pytest.raises(ConfigError, match=r"direction=\['maximize'\], but .* \['minimize'\]"):
        open_study(storage, "search", ["maximize"], random_sampler(0), NO_PRUNER)


class Direction(Enum):  # as Hydra's Optuna sweeper's config names them
    minimize = 1
    maximize = 2


@pytest.mark.parametrize(
    ("direction", "expected"),
    [
        ("maximize", ["maximize"]),
        (["minimize", "maximize"], ["minimize", "maximize"]),
        (OmegaConf.create({"d": ["maximize"]}).d, ["maximize"]),
        (Direction.minimize, ["minimize"]),
        ([Direction.maximize, "minimize"], ["maximize", "minimize"]),
    ],
)
def test_the_direction_is_one_objectives_or_a_list_of_several(direction, expected):
    assert study_directions(direction) == expected


@pytest.mark.parametrize("direction", ["max", ["minimize", "up"], []])
def test_a_direction_optuna_does_not_know_is_refused(direction):
    with pytest.raises(ConfigError, match="each objective is minimize or maximize"):
        study_directions(direction)


def job_return(value=None, error=None) -> JobReturn:
    job = JobReturn()
    job.status = JobStatus.FAILED if error else JobStatus.COMPLETED
    job.return_value = error or value
    return job


def test_each_trial_is_told_how_its_job_ended(tmp_path):
    study = open_study(
        f"sqlite:///{tmp_path}/s.db", "search", ["minimize"], random_sampler(0), NO_PRUNER
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
    reasons = [trial.user_attrs.get(FAIL_REASON) for trial in study.trials[2:]]
    assert "ValueError: bad input" in reasons[0], reasons
    assert "no metric named by `optimized_metric`" in reasons[1], reasons
    assert reasons[2] == "its run returned nan, not a number"


def test_a_trial_of_several_objectives_is_told_one_number_per_objective():
    study = open_study(None, None, ["minimize", "maximize"], random_sampler(0), NO_PRUNER)
    jobs = [job_return((0.5, 0.9)), job_return(0.5), job_return((0.5, None)), job_return([1, 2, 3])]
    told = [tell(study, study.ask(SPACE), job) for job in jobs]

    assert [trial.state for trial in told] == [TrialState.COMPLETE] + [TrialState.FAIL] * 3
    assert told[0].values == [0.5, 0.9]
    assert told[1].user_attrs[FAIL_REASON] == (
        "its run returned 0.5, not 2 numbers, one per objective"
    )


def test_the_grid_sampler_runs_each_point_once_and_its_end_stops_nothing():
    arguments = ["x=choice(1, 2)", "y=range(0, 3)"]
    distributions = search_space({}, arguments)[0]
    grid_sampler = OmegaConf.structured(SAMPLERS["grid"])
    grid = grid_space(distributions, arguments)
    study = open_study(None, "grid", ["minimize"], grid_sampler, NO_PRUNER, grid)
    for _ in range(6):
        trial = ask(study, distributions, n_trials=6)
        tell(study, trial, job_return(trial.params["x"] + trial.params["y"]))

    points = sorted((trial.params["x"], trial.params["y"]) for trial in study.trials)
    assert points == [(x, y) for x in (1, 2) for y in (0, 1, 2)]
    assert [trial.state for trial in study.trials] == [TrialState.COMPLETE] * 6


def test_the_results_file_holds_the_best_trial_or_the_pareto_front_as_hydras_sweeper_writes(
    tmp_path,
):
    single = open_study(None, "one", ["maximize"], random_sampler(0), NO_PRUNER)
    for value in (0.2, 0.7, 0.5):
        tell(single, single.ask(SPACE), job_return(value))
    write_results(single, tmp_path / "single.yaml")
    best = OmegaConf.load(tmp_path / "single.yaml")
    assert (best.name, best.best_trial, best.best_value) == ("optuna", 1, 0.7)
    assert best.best_params == single.trials[1].params

    pareto = open_study(None, "two", ["minimize", "maximize"], random_sampler(0), NO_PRUNER)
    for values in ((1.0, 1.0), (2.0, 3.0), (3.0, 2.0), (0.5, 0.5)):
        tell(pareto, pareto.ask(SPACE), job_return(values))
    write_results(pareto, tmp_path / "pareto.yaml")
    front = OmegaConf.to_container(OmegaConf.load(tmp_path / "pareto.yaml"))
    assert front["name"] == "optuna"
    assert "best_value" not in front
    assert front["solutions"] == [
        {"trial": trial.number, "params": trial.params, "values": trial.values}
        for trial in (pareto.trials[0], pareto.trials[1], pareto.trials[3])
    ], "trial 2 is dominated by trial 1, and only it"


def test_a_resumed_study_fails_the_trials_a_killed_sweep_left_running_and_no_others(tmp_path):
    storage = f"sqlite:///{tmp_path}/s.db"
    study = open_study(storage, "search", ["minimize"], random_sampler(0), NO_PRUNER)
    killed = subprocess.Popen([sys.executable, "-c", "pass"])
    killed.wait()  # a sweep process that is gone
    owners = {
        "killed here": {"host": socket.gethostname(), "pid": killed.pid},
        "alive here": {"host": socket.gethostname(), "pid": os.getpid()},
        "on another machine": {"host": "node-17", "pid": killed.pid},
    }
    for owner in owners.values():
        study.ask(SPACE).set_user_attr(ASKED_BY, owner)
    asked = ask(study, SPACE, n_trials=4)
    assert asked.user_attrs[ASKED_BY] == owners["alive here"]

    resumed = open_study(storage, "search", ["minimize"], random_sampler(0), NO_PRUNER)
    states = [trial.state for trial in resumed.trials]
    assert states == [TrialState.FAIL, *[TrialState.RUNNING] * 3]


def test_launches_that_share_a_study_ask_n_trials_in_all(tmp_path):
    storage = f"sqlite:///{tmp_path}/s.db"
    launches = [
        open_study(storage, "search", ["minimize"], random_sampler(0), NO_PRUNER) for _ in "ab"
    ]
    asked = [ask(launches[index % 2], SPACE, n_trials=3) for index in range(5)]

    assert [trial.number for trial in asked[:3]] == [0, 1, 2]
    assert asked[3:] == [None, None], "a launch asked past the study's n_trials"
    raised = ask(launches[0], SPACE, n_trials=4)
    assert raised is not None
    assert raised.number == 3, "a higher n_trials does not run the trials it adds"


def test_a_trial_asked_at_the_same_moment_as_the_last_one_is_failed_unrun(tmp_path, monkeypatch):
    storage = f"sqlite:///{tmp_path}/s.db"
    first, second = (
        open_study(storage, "search", ["minimize"], random_sampler(0), NO_PRUNER) for _ in "ab"
    )
    counted = second.get_trials(deepcopy=False)  # both count the study's trials, then both ask
    monkeypatch.setattr(second, "get_trials", lambda **_: counted)

    assert ask(first, SPACE, n_trials=1) is not None
    assert ask(second, SPACE, n_trials=1) is None
    last, extra = first.get_trials()
    assert (last.state, extra.state) == (TrialState.RUNNING, TrialState.FAIL)
    assert "another launch asked for the last of" in extra.user_attrs[FAIL_REASON]


def test_launches_that_share_a_study_and_its_seed_draw_different_values(tmp_path):
    storage = f"sqlite:///{tmp_path}/s.db"
    # Both open the study before either asks: they see the same history, and the same seed.
    launches = [
        open_study(storage, "search", ["minimize"], random_sampler(0), NO_PRUNER) for _ in "ab"
    ]
    drawn = [ask(launch, SPACE, n_trials=2).params["x"] for launch in launches]

    assert drawn[0] != drawn[1], "two launches drew the same trial"
    assert first_values(f"sqlite:///{tmp_path}/alone.db", 1) == drawn[:1], (
        "the first launch did not draw what the same command draws alone"
    )


def test_a_journal_file_holds_the_study_its_folder_created_relative_to_the_working_dir(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    url = "journal:///nested/study.log"
    study = open_study(url, "search", ["minimize"], random_sampler(0), NO_PRUNER)
    tell(study, ask(study, SPACE, n_trials=1), job_return(0.5))

    assert (tmp_path / "nested" / "study.log").is_file()
    reread = optuna.load_study(study_name="search", storage=open_storage(url))
    assert [trial.value for trial in reread.trials] == [0.5]
    absolute = open_storage(f"journal:///{tmp_path}/other.log")  # journal:////tmp/...
    assert absolute.get_all_studies() == []
    assert (tmp_path / "other.log").is_file()


@pytest.mark.parametrize("url", ["optuna.db", "foo://host/db", "postgresql://host:port/db"])
def test_a_storage_url_that_names_no_storage_is_refused_in_one_line(url):
    with pytest.raises(ConfigError, match="is no storage URL: give an SQLAlchemy URL"):
        open_storage(url)


def test_a_database_whose_driver_is_missing_names_the_package_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg", None)  # importing it fails, as when missing
    with pytest.raises(ConfigError, match="needs the database driver psycopg") as error:
        open_storage("postgresql+psycopg://optuna:secret@db.example/optuna")
    assert str(error.value).endswith('which is not installed: pip install "psycopg[binary]".')
    assert "secret" not in str(error.value), "the password was shown"


def test_a_database_server_that_does_not_answer_is_refused_with_what_to_check(tmp_path):
    pytest.importorskip("psycopg")
    url = f"postgresql+psycopg://optuna:secret@/optuna?host={tmp_path}"  # no server there
    with pytest.raises(ConfigError, match="cannot be opened") as error:
        open_storage(url)
    message = str(error.value)
    assert "No such file or directory" in message, message
    assert message.endswith(
        "check that the server runs and takes the URL's host, port, user, password and database."
    ), message
    assert "secret" not in message, "the password was shown"


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # QMCSampler
@pytest.mark.parametrize(
    ("name", "node"),
    [*((name, OmegaConf.structured(node)) for name, node in SAMPLERS.items()), *PRUNERS.items()],
)
def test_every_sampler_and_pruner_option_builds(name, node):
    if name == "motpe":
        with pytest.raises(InstantiationException, match="'motpe' sampler was removed"):
            instantiate(node)
        return
    built = instantiate(node)
    if name == "grid":  # partial: the sweeper gives it the grid
        built = built({"x": [1, 2]})
    assert isinstance(built, optuna.samplers.BaseSampler | optuna.pruners.BasePruner), name


def test_the_sweeper_is_registered_as_optuna_and_as_optuna_ask_tell():
    from hydra.core.config_store import ConfigStore

    groups = ConfigStore.instance().repo["hydra"]["sweeper"]
    assert groups["optuna.yaml"].node == groups["optuna_ask_tell.yaml"].node
    assert groups["optuna.yaml"].node._target_.endswith("optuna_ask_tell.sweeper.OptunaSweeper")


# -- the sweeper's trials and failures -----------------------------------------------------------


def suggest_z_near_x(cfg, trial):
    """A custom search space as Hydra's Optuna sweeper documents it."""
    trial.suggest_float("z", trial.params["x"] - cfg.spread, trial.params["x"] + cfg.spread)


def test_a_custom_search_space_suggests_more_parameters_after_the_sampled_and_fixed_ones():
    study = open_study(None, None, ["minimize"], random_sampler(0), NO_PRUNER)
    maker = TrialMaker(study, SPACE, {"y": "3"}, ["~w"], f"{__name__}.suggest_z_near_x", 1)
    trial = maker.ask(OmegaConf.create({"spread": 0.1}))

    assert abs(trial.params["z"] - trial.params["x"]) <= 0.1
    assert trial.user_attrs["y"] == "3", "a fixed value is recorded on the trial"
    assert maker.overrides(trial) == [
        f"x={trial.params['x']}",
        f"z={trial.params['z']}",
        "y=3",
        "~w",
    ]


def test_a_custom_search_space_that_suggests_a_fixed_parameter_is_refused():
    study = open_study(None, None, ["minimize"], random_sampler(0), NO_PRUNER)
    maker = TrialMaker(study, SPACE, {"z": "0.5"}, [], f"{__name__}.suggest_z_near_x", 1)
    with pytest.raises(ConfigError, match=r"suggests \['z'\], which the command line"):
        maker.ask(OmegaConf.create({"spread": 0.1}))


def test_a_custom_search_space_that_names_no_function_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"custom_search_space='nowhere\.configure' names no"):
        custom_function("nowhere.configure")


def test_a_search_of_several_objectives_with_a_pruner_is_refused_before_any_trial():
    median = OmegaConf.create({"_target_": "optuna.pruners.MedianPruner"})
    with pytest.raises(ConfigError, match="Optuna prunes single-objective searches only"):
        check_pruning(["minimize", "maximize"], median)
    check_pruning(["minimize"], median)
    check_pruning(["minimize", "maximize"], NO_PRUNER)


@pytest.mark.parametrize("rate", [-0.1, 1.5])
def test_a_failure_rate_outside_0_to_1_is_refused(rate):
    with pytest.raises(ConfigError, match=rf"max_failure_rate={rate}: it is the share"):
        check_failure_rate(rate)


# -- the sweeper's batches and the launcher's GPUs ----------------------------------------------


def test_trials_are_asked_in_batches_of_n_jobs_until_the_study_holds_n_trials():
    study = open_study(None, None, ["minimize"], random_sampler(0), NO_PRUNER)
    maker = TrialMaker(study, SPACE, {}, [], None, n_trials=5)
    sizes = []
    while batch := maker.ask_batch(OmegaConf.create(), 2):
        sizes.append(len(batch))
        for trial in batch:
            tell(study, trial, job_return(0.5))
    assert sizes == [2, 2, 1]


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


# -- what a run returns to the sweeper -----------------------------------------------------------


def test_a_run_returns_its_optimized_metric_or_a_tuple_for_several():
    metrics = {"val/acc_best": 0.9, "val/loss": 0.3}
    assert optimized_value(metrics, "val/loss") == 0.3
    assert optimized_value(metrics, ["val/acc_best", "val/loss"]) == (0.9, 0.3)
    assert optimized_value(metrics, OmegaConf.create(["val/loss", "test/acc"])) == (0.3, None)
    assert optimized_value(metrics, None) is None


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
def test_a_search_resumed_with_a_higher_n_trials_runs_the_rest_without_repeating_trials(tmp_path):
    storage = f"sqlite:///{tmp_path}/study.db"
    no_pruning = "hydra/sweeper/pruner=none"
    search(tmp_path / "first", "hydra.sweeper.n_trials=4", no_pruning, storage=storage)
    study = search(tmp_path / "resumed", "hydra.sweeper.n_trials=6", no_pruning, storage=storage)

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
    # No test stage: ddp_spawn would start both ranks afresh for it.
    ddp = ["trainer=ddp_cpu", "trainer.strategy=ddp_spawn", "test=false"]
    study = search(tmp_path, *PRUNE_AT_ONCE, *ddp)

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
