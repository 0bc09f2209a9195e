"""Sweeps: an Optuna search end to end, the SLURM launcher's job parameters and its jobs run by
submitit locally, the summary, its plot and, for several metrics, its Pareto front."""

import csv
import json

import optuna
import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf
from optuna.trial import TrialState

from src.run.config.compose import CONF_DIR
from src.run.launch import register_launch_resolvers
from src.run.outputs import METRICS_FILE
from src.run.search.pareto import pareto_front, plot_pareto_front
from src.run.search.sweep_summary import SweepSummary, importance_table, plot_metric
from src.utils.errors import ConfigError
from tests.helpers import FAST, run_train


@pytest.mark.slow
def test_optuna_search_writes_a_summary_whose_best_row_is_optunas_best_trial(tmp_path):
    run_train(
        ["hparams_search=optuna", "hydra.sweeper.n_trials=3", f"hydra.sweep.dir={tmp_path}", *FAST]
    )

    for name in ("summary.md", "summary.csv", "summary.png", "optimization_results.yaml"):
        assert (tmp_path / name).is_file(), f"the sweep wrote no {name}"
    with (tmp_path / "summary.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert [row["status"] for row in rows] == ["ok"] * 3
    assert [row["state"] for row in rows] == ["COMPLETE"] * 3, "the trials' states are missing"
    best_row = max(rows, key=lambda row: float(row["val/acc_best"]))
    optuna_result = OmegaConf.load(tmp_path / "optimization_results.yaml")
    assert float(best_row["val/acc_best"]) == optuna_result.best_value
    for param, value in optuna_result.best_params.items():
        assert best_row[param] == str(value), f"{param}: summary {best_row[param]}, optuna {value}"
    assert f"{best_row['job']} (best)" in (tmp_path / "summary.md").read_text()


def slurm_launcher_config(*overrides: str) -> dict:
    """The resolved `hydra.launcher` that `python train.py -m hydra/launcher=slurm ...` uses."""
    register_launch_resolvers()  # as train.py does: the sweep dir is named by `launch_name`
    initialize_config_dir(config_dir=CONF_DIR, version_base="1.3")
    cfg = compose("train", overrides=["hydra/launcher=slurm", *overrides], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert type(instantiate(launcher)).__name__ == "SlurmLauncher"
    return OmegaConf.to_container(launcher, resolve=True)


def test_slurm_launcher_asks_for_one_task_per_device_on_every_node():
    launcher = slurm_launcher_config(
        "hydra.launcher.partition=a100", "trainer=ddp", "trainer.devices=4", "trainer.num_nodes=2"
    )
    assert launcher["partition"] == "a100"
    assert launcher["gpus_per_node"] == launcher["tasks_per_node"] == 4
    assert launcher["nodes"] == 2
    assert launcher["timeout_min"] == 240
    # Time to requeue before the limit; requeued at most max_num_timeout times.
    assert launcher["signal_delay_s"] >= 60
    assert launcher["max_num_timeout"] > 0


def test_slurm_launcher_defaults_to_one_gpu_per_job():
    launcher = slurm_launcher_config()
    assert (launcher["nodes"], launcher["tasks_per_node"], launcher["gpus_per_node"]) == (1, 1, 1)


@pytest.mark.slow
def test_submitit_runs_each_job_from_its_pickled_task_into_one_sweep_directory(tmp_path):
    # submitit's local executor takes the path SLURM jobs take: each job unpickles the task
    # and Hydra's callbacks in a fresh process and resolves the sweep directory there.
    sweep = ["-m", "hydra/launcher=submitit_local", "seed=1,2", f"paths.log_dir={tmp_path}"]
    run_train([*sweep, *FAST, "model=simplenet", "test=false"])
    (sweep_dir,) = (tmp_path / "train" / "multiruns").iterdir()
    with (sweep_dir / "summary.csv").open() as file:
        assert [row["status"] for row in csv.DictReader(file)] == ["ok", "ok"]
    assert all((sweep_dir / job / "metrics.json").is_file() for job in ("0", "1"))


def test_plot_has_one_axis_per_swept_parameter_log_scaled_when_values_span_decades():
    rows = [
        {"job": "0", "lr": 1e-4, "batch": 32, "model": "cnn", "val/acc_best": 0.5},
        {"job": "1", "lr": 3e-3, "batch": 64, "model": "simplenet", "val/acc_best": 0.8},
        {"job": "2", "lr": 1e-2, "batch": 128, "model": "cnn", "val/acc_best": 0.7},
        {"job": "3", "lr": 1e-3, "batch": 32, "model": "cnn", "status": "failed"},
    ]
    figure = plot_metric(rows, "val/acc_best", ["lr", "batch", "model"])

    assert len(figure.axes) == 3
    lr, batch, model = figure.axes
    assert [axis.get_xlabel() for axis in figure.axes] == ["lr", "batch", "model"]
    assert (lr.get_xscale(), batch.get_xscale()) == ("log", "linear")
    assert [label.get_text() for label in model.get_xticklabels()] == ["cnn", "simplenet"]
    assert len(lr.collections[0].get_offsets()) == 3, "the job without the metric is plotted"


@pytest.mark.parametrize(("mode", "best"), [("max", "1"), ("minimize", "0")])
def test_best_job_follows_the_direction_of_the_search(mode, best):
    rows = [{"job": "0", "val/loss": 0.2}, {"job": "1", "val/loss": 0.9}, {"job": "2"}]
    assert SweepSummary(metric="val/loss", mode=mode).best_job(rows) == best


def test_a_pruned_trial_is_never_the_best_job():
    rows = [
        {"job": "0", "val/acc_best": 0.9, "state": "PRUNED"},
        {"job": "1", "val/acc_best": 0.5, "state": "COMPLETE"},
    ]
    assert SweepSummary(metric="val/acc_best").best_job(rows) == "1"


def write_sweep(sweep_dir, jobs: dict[str, tuple[list[str], dict | None]]) -> None:
    """A sweep: each job's overrides and, once it ended, its metrics.json, as a multirun leaves
    them."""
    for job, (overrides, metrics) in jobs.items():
        (sweep_dir / job / ".hydra").mkdir(parents=True)
        OmegaConf.save(OmegaConf.create(overrides), sweep_dir / job / ".hydra" / "overrides.yaml")
        if metrics is not None:
            record = {"metrics": metrics, "wall_time_s": 1.0}
            (sweep_dir / job / METRICS_FILE).write_text(json.dumps(record))


def test_a_sweep_of_two_metrics_marks_and_plots_its_pareto_front(tmp_path):
    write_sweep(
        tmp_path,
        {
            "0": (["lr=0.1"], {"val/acc": 0.9, "val/loss": 0.5}),
            "1": (["lr=0.2"], {"val/acc": 0.8, "val/loss": 0.2}),
            "2": (["lr=0.3"], {"val/acc": 0.7, "val/loss": 0.6}),  # worse than 0 on both
            "3": (["lr=0.4"], {"val/acc": 0.95, "val/loss": 0.9}),
        },
    )
    summary = SweepSummary(metric=["val/acc", "val/loss"], mode=["maximize", "minimize"])
    summary.on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))

    text = (tmp_path / "summary.md").read_text()
    assert "Pareto front of `val/acc` (max), `val/loss` (min): jobs 0, 1, 3" in text, text
    marked = [line.split(" |")[0] for line in text.splitlines() if "(Pareto)" in line]
    assert marked == ["| 0 (Pareto)", "| 1 (Pareto)", "| 3 (Pareto)"]
    assert "(best)" not in text
    assert (tmp_path / "summary.png").is_file(), "the Pareto front was not plotted"


def test_a_trial_another_launch_still_runs_is_listed_as_running_and_fails_nothing(tmp_path):
    # Two launches share the study and the sweep directory: this one ended, the other still runs
    # trial 1, whose job has no metrics.json yet.
    write_sweep(tmp_path, {"0": (["lr=0.1"], {"val/acc": 0.9}), "1": (["lr=0.2"], None)})
    storage = f"sqlite:///{tmp_path}/optuna.db"
    study = optuna.create_study(storage=storage, study_name="search", direction="maximize")
    study.tell(study.ask(), 0.9)
    study.ask()

    summary = SweepSummary(metric="val/acc", storage=storage, study_name="search")
    summary.on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))

    with (tmp_path / "summary.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert [(row["status"], row["state"]) for row in rows] == [
        ("ok", "COMPLETE"),
        ("running", "RUNNING"),
    ]


def test_the_pareto_front_keeps_every_point_no_other_beats_everywhere():
    points = {"a": [1.0, 5.0], "b": [2.0, 2.0], "c": [2.0, 2.0], "d": [3.0, 3.0], "e": [5.0, 1.0]}
    # Minimise both: d is beaten by b; b and c tie, so neither dominates the other.
    assert pareto_front(points, [False, False]) == ["a", "b", "c", "e"]
    # Maximise the second: a alone has the highest, e the lowest first.
    assert pareto_front(points, [False, True]) == ["a"]


def test_the_pareto_plot_draws_each_pair_of_objectives_and_names_the_fronts_jobs():
    points = {"0": [1.0, 3.0, 0.5], "1": [2.0, 1.0, 0.4], "2": [3.0, 3.0, 0.9]}
    figure = plot_pareto_front(points, ["0", "1"], ["a", "b", "c"])

    labels = [(axis.get_xlabel(), axis.get_ylabel()) for axis in figure.axes]
    assert labels == [("a", "b"), ("a", "c"), ("b", "c")]
    assert sorted(text.get_text() for text in figure.axes[0].texts) == ["0", "1"]


def test_a_mode_per_metric_must_pair_with_the_metrics():
    with pytest.raises(ConfigError, match="give one mode, or one per metric"):
        SweepSummary(metric=["a", "b", "c"], mode=["max", "min"])


def test_importance_has_one_column_per_objective():
    table = importance_table({"val/acc": {"lr": 0.75, "batch": 0.25}, "val/loss": {"lr": 0.5}})
    assert "| parameter | val/acc | val/loss |" in table
    assert "| lr | 0.7500 | 0.5000 |" in table
    assert "| batch | 0.2500 |  |" in table


@pytest.mark.slow
def test_a_search_of_two_objectives_through_train_writes_its_pareto_front(tmp_path):
    run_train(
        [
            "hparams_search=optuna_multi_objective",
            "hydra.sweeper.n_trials=3",
            f"hydra.sweep.dir={tmp_path}",
            *FAST,
        ]
    )

    study = optuna.load_study(study_name="search", storage=f"sqlite:///{tmp_path}/optuna.db")
    assert [d.name for d in study.directions] == ["MAXIMIZE", "MINIMIZE"]
    assert [trial.state for trial in study.trials] == [TrialState.COMPLETE] * 3
    results = OmegaConf.load(tmp_path / "optimization_results.yaml")
    front = sorted(study.best_trials, key=lambda trial: trial.number)
    assert [s.trial for s in results.solutions] == [trial.number for trial in front]
    for solution, trial in zip(results.solutions, front, strict=True):
        metrics = json.loads((tmp_path / str(trial.number) / METRICS_FILE).read_text())["metrics"]
        assert list(solution["values"]) == [metrics["val/acc_best"], metrics["val/loss"]]
    text = (tmp_path / "summary.md").read_text()
    jobs = ", ".join(str(trial.number) for trial in front)
    assert f"`val/acc_best` (max), `val/loss` (min): jobs {jobs}" in text, text
    assert (tmp_path / "summary.png").is_file()
