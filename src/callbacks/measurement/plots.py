"""Pictures of a run in its directory: training and validation curves, throughput, final metrics.

The final metrics go to TensorBoard's HParams tab.
"""

import logging
import math
import re
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from src.callbacks.measurement.throughput import Throughput
from src.utils.errors import first_line
from src.utils.lightning import as_number, metrics_logged_this_step

log = logging.getLogger(__name__)

History = dict[str, list[tuple[int, float]]]
CURVE_STAGES = ("train", "val")
FINAL_STAGES = ("train", "val", "test")
DOTTED_UP_TO = 50  # points a series can have and still show each as a dot


class Plots(Callback):
    """Records the logged scalars while training and draws them when training ends (rank 0).

    It draws:

    - `<dirpath>/curves.png`: every `train/*` and `val/*` scalar against the optimizer step, one
      panel per quantity (`train/loss_step`, `train/loss` and `val/loss` share the `loss` panel);
    - `<dirpath>/throughput.png`: the `perf/*_per_s` rates over each logging window, as the
      throughput callback measured them (its steady state so far at each epoch end when the
      run has no throughput callback's windows), from zero up.

    Values are recorded as the loggers receive them: on each logging step, the step values the
    module logged (`train/loss_step` of the classifier, `train/loss` of the LM); at the end of
    each validation, `val/*`; once an epoch is over, its epoch values (`train/*`, `perf/*`).
    A series equal to another (a metric logged under two names) is drawn once, and a series of
    one point as a marker with a note. A resumed run draws what it trained itself (the loggers
    hold the whole run). With a TensorBoard logger, the final metrics are also written as
    HParams metrics (`hp/<metric>`) after fitting and after testing.
    """

    def __init__(self, dirpath: str):
        self.dirpath = Path(dirpath)
        self.history: History = defaultdict(list)
        self.step_keys: set[str] = set()  # the keys logged per step, not per epoch
        self._epoch_end_step: int | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The model graph in TensorBoard, for modules that give a sample input.

        Those are the classifiers; tracing the LM is neither cheap nor warning-free.
        """
        sample = getattr(pl_module, "example_input_array", None)
        if not trainer.is_global_zero or not isinstance(sample, torch.Tensor):
            return
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                with warnings.catch_warnings():  # TensorBoard traces with the deprecated jit
                    warnings.filterwarnings("ignore", "`torch.jit.trace", FutureWarning)
                    warnings.filterwarnings("ignore", category=DeprecationWarning)  # metrics' own
                    try:
                        logger.experiment.add_graph(pl_module, sample.to(pl_module.device))
                    except Exception as error:  # noqa: BLE001 - a picture never fails a run
                        # The first line only: a failed trace check lists `ERROR: ...` lines.
                        log.info("No model graph in TensorBoard (%s)", first_line(error))

    # -- recording ---------------------------------------------------------------------------

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step_values = {
            key: value
            for key, value in metrics_logged_this_step(trainer).items()
            if key.startswith("train/")
        }
        self.step_keys |= step_values.keys()
        self._record(step_values, trainer.global_step)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            values = trainer.callback_metrics
            self._record(
                {k: v for k, v in values.items() if k.startswith("val/")}, trainer.global_step
            )

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # The module logs its epoch metrics after this hook: read them at the next epoch's start.
        self._epoch_end_step = trainer.global_step

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._record_epoch(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._record_epoch(trainer)
        if trainer.is_global_zero:
            self.draw(throughput_windows(trainer))

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        log_final_hparams(trainer)

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        log_final_hparams(trainer)

    def _record_epoch(self, trainer: Trainer) -> None:
        if self._epoch_end_step is None:
            return
        # A key logged per step stays in the callback metrics: at the epoch's end it holds the
        # last step's value, already recorded.
        epoch_values = {
            key: value
            for key, value in trainer.callback_metrics.items()
            if key.startswith(("train/", "perf/")) and key not in self.step_keys
        }
        self._record(epoch_values, self._epoch_end_step)
        self._epoch_end_step = None

    def _record(self, values: dict[str, Any], step: int) -> None:
        for key, value in values.items():
            if isinstance(number := as_number(value), int | float):
                self.history[key].append((step, float(number)))

    # -- results -----------------------------------------------------------------------------

    def draw(self, windows: History | None = None) -> None:
        """Write the PNGs of whatever was recorded; `windows`: rates per logging window."""
        for name, figure in self.figures(windows).items():
            save_figure(figure, self.dirpath / name)
            log.info("Plot: %s", self.dirpath / name)

    def figures(self, windows: History | None = None) -> dict[str, Figure]:
        """The figures by file name, of the series recorded (none for an empty group)."""
        curves = {k: v for k, v in self.history.items() if k.split("/")[0] in CURVE_STAGES}
        rates = {k: v for k, v in self.history.items() if k.startswith("perf/") and "_per_s" in k}
        rates_title = "Steady-state throughput so far, at each epoch end"
        if windows:
            rates, rates_title = windows, "Throughput over each logging window"
        figures = {}
        if curves:
            figures["curves.png"] = plot_series(curves, "Training and validation")
        if rates:
            figures["throughput.png"] = plot_series(rates, rates_title, from_zero=True)
        return figures


def throughput_windows(trainer: Trainer) -> History:
    """The `perf/*_per_s` rates of the Throughput callback's logging windows, by key."""
    series: History = defaultdict(list)
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning, undeclared on Trainer
        if not isinstance(callback, Throughput):
            continue
        for step, rates in callback.windows:
            for key, value in rates.items():
                if key.startswith("perf/") and "_per_s" in key:
                    series[key].append((step, value))
    return series


def quantity(key: str) -> str:
    """The panel of a metric: `train/loss_step`, `train/loss` and `val/loss` all draw `loss`."""
    return re.sub(r"_(step|epoch|best)$", "", key.split("/", 1)[-1])


def distinct_series(history: History) -> dict[str, list[tuple[int, float]]]:
    """`history` with each series that equals an earlier one (by key order) folded into it.

    The series is kept under a label naming both: `train/acc = train/acc_epoch`.
    """
    aliases: dict[str, list[str]] = {}  # first key of a series: every key holding it
    for key in sorted(history):
        twin = next((kept for kept in aliases if same_points(history[kept], history[key])), None)
        aliases.setdefault(twin or key, []).append(key)
    return {" = ".join(keys): history[first] for first, keys in aliases.items()}


def same_points(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    """Whether two series hold the same values at the same steps (up to float rounding)."""
    return len(a) == len(b) and all(
        step_a == step_b and math.isclose(value_a, value_b, rel_tol=1e-9, abs_tol=1e-12)
        for (step_a, value_a), (step_b, value_b) in zip(a, b, strict=True)
    )


def single_point_note(label: str) -> str:
    """What a lone point means, for the note beside it."""
    if label.startswith("val/"):
        return "one validation so far"
    if label.startswith("perf/"):
        return "one measurement so far"
    return "one epoch so far" if "_step" not in label else "one logged step so far"


def plot_series(history: History, title: str, from_zero: bool = False) -> Figure:
    """One panel per quantity, every distinct series of that quantity against the step.

    With `from_zero`, y axes start at 0, so that rates compare by height.
    """
    panels: dict[str, dict[str, list[tuple[int, float]]]] = defaultdict(dict)
    for label, points in distinct_series(history).items():
        panels[quantity(label.split(" = ")[0])][label] = points
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    figure = Figure(figsize=(4.5 * ncols, 3.2 * nrows), layout="constrained")
    FigureCanvasAgg(figure)  # render with Agg, without pyplot's global state
    figure.suptitle(title)
    for index, (name, series) in enumerate(panels.items()):
        axes = figure.add_subplot(nrows, ncols, index + 1)
        for label, points in series.items():
            steps, values = zip(*points, strict=True)
            lone = len(points) == 1
            marker = "o" if len(points) <= DOTTED_UP_TO else None
            axes.plot(steps, values, marker=marker, markersize=7 if lone else 3, label=label)
            if lone:
                axes.annotate(
                    single_point_note(label),
                    (steps[0], values[0]),
                    xytext=(6, 6),
                    textcoords="offset points",
                    fontsize="small",
                )
        axes.set(title=name, xlabel="step")
        axes.set_xlim(left=0)  # a lone point sits where it was in the run, not alone in a void
        if from_zero:
            axes.set_ylim(bottom=0)
        axes.legend(fontsize="small")
    return figure


def save_figure(figure: Figure, path: Path) -> None:
    """Write `figure` as a PNG (or by `path`'s suffix), creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def log_final_hparams(trainer: Trainer) -> None:
    """The run's hyperparameters with its final metrics, for TensorBoard's HParams tab.

    The metrics go under `hp/`: TensorBoard also records them as scalars at step 0, which would
    otherwise add a point at step 0 to the training curves.
    """
    if not trainer.is_global_zero:
        return
    metrics = {
        f"hp/{key}": number
        for key, value in trainer.callback_metrics.items()
        if key.split("/")[0] in FINAL_STAGES and isinstance(number := as_number(value), int | float)
    }
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger) and metrics:
            logger.log_hyperparams(logger.hparams, metrics=metrics)
