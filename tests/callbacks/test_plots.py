"""The plots callback: PNGs of a digits and a language-model run, holding every logged point
once, and HParams metrics."""

import csv

import hydra
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from src.callbacks.measurement.plots import Plots, throughput_windows
from src.run.trainer import build_trainer, plain_config
from tests.helpers import FAST, TINY_LM, compose_config

EPOCHS = 2
LM_STEPS, LM_LOG_EVERY, LM_VALIDATE_AT = 10, 2, 8


def fit(run_dir, overrides, test=False):
    """A run fitted (and tested) in this process: its trainer and plots callback."""
    cfg = compose_config(run_dir, [*FAST, *overrides])
    trainer = build_trainer(cfg, run_config=(plain_config(cfg), []))
    model, datamodule = hydra.utils.instantiate(cfg.model), hydra.utils.instantiate(cfg.data)
    trainer.fit(model, datamodule=datamodule)
    if test:
        trainer.test(model, datamodule=datamodule)
    return trainer, next(callback for callback in trainer.callbacks if isinstance(callback, Plots))


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A digits run fitted for two epochs and tested, with CSV and TensorBoard loggers."""
    run_dir = tmp_path_factory.mktemp("run")
    trainer, plots = fit(run_dir, [f"trainer.max_epochs={EPOCHS}", "logger=many"], test=True)
    return run_dir, plots.history, plots.figures(throughput_windows(trainer))


@pytest.fixture(scope="module")
def language_model(tmp_path_factory):
    """A tiny byte-level LM trained for a few steps, logging every other step and validating
    once; its run dir, plots callback and figures."""
    run_dir = tmp_path_factory.mktemp("lm")
    trainer, plots = fit(
        run_dir,
        [
            "experiment=lm_shakespeare",
            *TINY_LM[1:],
            "model.config.num_hidden_layers=1",
            "data.max_seq_len=16",
            "data.batch_size=2",
            "trainer.precision=32-true",
            "trainer.max_epochs=-1",
            f"trainer.max_steps={LM_STEPS}",
            f"trainer.log_every_n_steps={LM_LOG_EVERY}",
            f"trainer.val_check_interval={LM_VALIDATE_AT}",
            "trainer.limit_val_batches=1",
            "logger=csv",
            "test=false",
        ],
    )
    return run_dir, plots, plots.figures(throughput_windows(trainer))


def drawn_lines(figure):
    """(panel title, line label, steps, values) of every line in `figure`."""
    return [
        (axes.get_title(), line.get_label(), tuple(line.get_xdata()), tuple(line.get_ydata()))
        for axes in figure.axes
        for line in axes.lines
    ]


def points_drawn(figure, key):
    """How many points the line that `key` is drawn in (alone or with its aliases) holds."""
    for _, label, steps, _ in drawn_lines(figure):
        if key in label.split(" = "):
            return len(steps)
    raise AssertionError(f"{key} is drawn in no line: {[line[1] for line in drawn_lines(figure)]}")


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
        assert png[:4] == b"\x89PNG", f"{name}: {len(png)} bytes"
        assert len(png) > 10_000, f"{name}: {len(png)} bytes"


# Values per run: per-epoch metrics once an epoch; the step loss every log_every_n_steps=10 of
# the 20 steps of each digits epoch.
LOGGED = {"train/loss_step": EPOCHS * 20 // 10} | dict.fromkeys(
    ["train/loss", "train/acc", "val/loss", "val/acc", "val/acc_best"], EPOCHS
)


@pytest.mark.parametrize(("key", "count"), LOGGED.items())
def test_curves_hold_every_logged_point(fitted, key, count):
    run_dir, history, figures = fitted
    logged = logged_values(run_dir, key)
    assert len(logged) == count, f"{key}: {len(logged)} values logged"
    assert [value for _, value in history[key]] == pytest.approx(logged)
    drawn = points_drawn(figures["curves.png"], key)
    assert drawn == len(logged), f"{key}: {drawn} points drawn, {len(logged)} logged"


def test_throughput_is_drawn_for_every_logging_window(fitted):
    run_dir, history, figures = fitted
    with open(run_dir / "csv" / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("perf/samples_per_s")]
    window_rows = [float(row["perf/samples_per_s"]) for row in rows if not row["epoch"]]
    assert len(window_rows) > EPOCHS
    drawn = next(
        line for line in drawn_lines(figures["throughput.png"]) if line[0] == "samples_per_s"
    )
    assert list(drawn[3]) == pytest.approx(window_rows)
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


def test_lm_curves_hold_the_loss_of_every_logged_step(language_model):
    run_dir, plots, figures = language_model
    logged = logged_values(run_dir, "train/loss")
    steps = list(range(LM_LOG_EVERY, LM_STEPS + 1, LM_LOG_EVERY))
    assert len(logged) == len(steps), f"{len(logged)} training losses logged"
    assert [step for step, _ in plots.history["train/loss"]] == steps
    assert [value for _, value in plots.history["train/loss"]] == pytest.approx(logged)
    assert points_drawn(figures["curves.png"], "train/loss") == len(steps)


@pytest.mark.parametrize("name", ["curves.png", "throughput.png"])
def test_no_two_panels_draw_the_same_series(language_model, fitted, name):
    for figure in (language_model[2][name], fitted[2][name]):
        series = [(steps, values) for _, _, steps, values in drawn_lines(figure)]
        assert len(set(series)) == len(series), [line[:2] for line in drawn_lines(figure)]


def test_equal_throughput_rates_share_one_line(language_model):
    # Packed rows without padding: every token slot is a real, supervised token.
    _, _, figures = language_model
    labels = [label for _, label, _, _ in drawn_lines(figures["throughput.png"])]
    shared = "perf/real_tokens_per_s = perf/supervised_tokens_per_s = perf/tokens_per_s"
    assert shared in labels, labels


def test_a_single_validation_is_a_visible_marked_point(language_model):
    _, plots, figures = language_model
    assert [step for step, _ in plots.history["val/loss"]] == [LM_VALIDATE_AT]
    axes = next(axes for axes in figures["curves.png"].axes if axes.get_title() == "loss")
    line = next(line for line in axes.lines if line.get_label() == "val/loss")
    assert line.get_marker() == "o"
    assert line.get_markersize() >= 5
    notes = [text.get_text() for text in axes.texts]
    assert notes == ["one validation so far"], notes


def test_throughput_axes_start_from_zero(language_model, fitted):
    for figure in (language_model[2]["throughput.png"], fitted[2]["throughput.png"]):
        bottoms = {axes.get_title(): axes.get_ylim()[0] for axes in figure.axes}
        assert set(bottoms.values()) == {0}, bottoms
