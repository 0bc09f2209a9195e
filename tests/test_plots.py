"""The plots callback: PNGs of a digits run, holding every logged point, and HParams metrics."""

import csv

import hydra
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from src.callbacks.plots import Plots, plot_series, throughput_windows
from src.run.trainer import build_trainer, plain_config
from tests.helpers import FAST, compose_config

EPOCHS = 2


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A digits run fitted for two epochs and tested, with CSV and TensorBoard loggers."""
    run_dir = tmp_path_factory.mktemp("run")
    cfg = compose_config(run_dir, [*FAST, f"trainer.max_epochs={EPOCHS}", "logger=many"])
    trainer = build_trainer(cfg, run_config=(plain_config(cfg), []))
    model, datamodule = hydra.utils.instantiate(cfg.model), hydra.utils.instantiate(cfg.data)
    trainer.fit(model, datamodule=datamodule)
    trainer.test(model, datamodule=datamodule)
    plots = next(callback for callback in trainer.callbacks if isinstance(callback, Plots))
    return run_dir, plots.history, throughput_windows(trainer)


def logged_values(run_dir, key, per_epoch=False):
    """The values of `key` the CSV logger wrote, in order (only the per-epoch ones: the rows
    logged through the module, which carry the epoch)."""
    with open(run_dir / "csv" / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get(key)]
    return [float(row[key]) for row in rows if row["epoch"] or not per_epoch]


def test_plots_are_written_as_non_empty_pngs(fitted):
    run_dir, _, _ = fitted
    for name in ("curves.png", "throughput.png"):
        png = (run_dir / "plots" / name).read_bytes()
        assert png[:4] == b"\x89PNG" and len(png) > 10_000, f"{name}: {len(png)} bytes"


# Values per run: per-epoch metrics once an epoch; the step loss every log_every_n_steps=10 of
# the 20 steps of each digits epoch.
LOGGED = {"train/loss_step": EPOCHS * 20 // 10} | dict.fromkeys(
    ["train/loss", "train/acc", "val/loss", "val/acc", "val/acc_best"], EPOCHS
)


@pytest.mark.parametrize(("key", "count"), LOGGED.items())
def test_curves_hold_every_logged_point(fitted, key, count):
    run_dir, history, _ = fitted
    logged = logged_values(run_dir, key)
    assert len(logged) == count, f"{key}: {len(logged)} values logged"
    assert [value for _, value in history[key]] == pytest.approx(logged)
    drawn = {
        line.get_label(): len(line.get_xdata())
        for axes in plot_series(history, "curves").axes
        for line in axes.lines
    }
    assert drawn[key] == len(logged), f"{key}: {drawn[key]} points drawn, {len(logged)} logged"


def test_throughput_is_drawn_for_every_logging_window(fitted):
    run_dir, history, windows = fitted
    with open(run_dir / "csv" / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("perf/samples_per_s")]
    window_rows = [float(row["perf/samples_per_s"]) for row in rows if not row["epoch"]]
    assert len(window_rows) > EPOCHS
    assert [value for _, value in windows["perf/samples_per_s"]] == pytest.approx(window_rows)
    # The epoch-end steady state is recorded too, one point per epoch.
    assert [value for _, value in history["perf/samples_per_s"]] == pytest.approx(
        logged_values(run_dir, "perf/samples_per_s", per_epoch=True)
    )


def test_final_metrics_reach_tensorboard_hparams(fitted):
    run_dir, _, _ = fitted
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"hp/val/acc", "hp/train/loss", "hp/test/acc"} <= scalars, sorted(scalars)
    assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")


def test_tensorboard_holds_the_classifiers_graph(fitted):
    run_dir, _, _ = fitted
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    graph = events.Graph()
    assert any("Linear" in node.op or "linear" in node.op for node in graph.node)
