"""Pictures of a run in its directory: training and validation curves, throughput, and the final
metrics in TensorBoard's HParams tab."""

import logging
import math
import re
import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from src.callbacks.throughput import Throughput
from src.utils.lightning import as_number, is_logging_step

log = logging.getLogger(__name__)

History = dict[str, list[tuple[int, float]]]
CURVE_STAGES = ("train", "val")
FINAL_STAGES = ("train", "val", "test")


class Plots(Callback):
    """Records the logged scalars while training and draws them when training ends (rank 0):

    - `<dirpath>/curves.png`: every `train/*` and `val/*` scalar against the optimizer step, one
      panel per quantity (`train/loss_step`, `train/loss` and `val/loss` share the `loss` panel);
    - `<dirpath>/throughput.png`: the `perf/*_per_s` rates over each logging window, as the
      throughput callback measured them (its steady state so far at each epoch end when the
      run has no throughput callback's windows).

    Values come from `trainer.callback_metrics` at the moments they are fresh: step values
    (`train/*_step`) on logging steps, `val/*` at the end of each validation, epoch values of
    training (`train/*`, `perf/*`) once the epoch is over. A resumed run draws what it trained
    itself (the loggers hold the whole run). With a TensorBoard logger, the final metrics are
    also written as HParams metrics (`hp/<metric>`) after fitting and after testing.
    """

    def __init__(self, dirpath: str):
        self.dirpath = Path(dirpath)
        self.history: History = defaultdict(list)
        self._epoch_end_step: int | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The model graph in TensorBoard, for modules that give a sample input (classifiers;
        tracing the LM is neither cheap nor warning-free)."""
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
                        log.info("No model graph in TensorBoard (%s)", error)

    # -- recording ---------------------------------------------------------------------------

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if is_logging_step(trainer):
            self._record(trainer, is_step_value)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._record(trainer, is_validation_value)

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
        self._record(trainer, is_epoch_value, step=self._epoch_end_step)
        self._epoch_end_step = None

    def _record(
        self, trainer: Trainer, wanted: Callable[[str], bool], step: int | None = None
    ) -> None:
        step = trainer.global_step if step is None else step
        for key, value in trainer.callback_metrics.items():
            if wanted(key) and isinstance(number := as_number(value), int | float):
                self.history[key].append((step, float(number)))

    # -- results -----------------------------------------------------------------------------

    def draw(self, windows: History | None = None) -> None:
        """Write the PNGs of whatever was recorded; `windows`: rates per logging window."""
        curves = {k: v for k, v in self.history.items() if k.split("/")[0] in CURVE_STAGES}
        rates = {k: v for k, v in self.history.items() if k.startswith("perf/") and "_per_s" in k}
        rates_title = "Steady-state throughput so far, at each epoch end"
        if windows:
            rates, rates_title = windows, "Throughput over each logging window"
        for name, series, title in (
            ("curves.png", curves, "Training and validation"),
            ("throughput.png", rates, rates_title),
        ):
            if series:
                save_figure(plot_series(series, title), self.dirpath / name)
                log.info("Plot: %s", self.dirpath / name)


def throughput_windows(trainer: Trainer) -> History:
    """The `perf/*_per_s` rates of the Throughput callback's logging windows, by key."""
    series: History = defaultdict(list)
    for callback in trainer.callbacks:
        if not isinstance(callback, Throughput):
            continue
        for step, rates in callback.windows:
            for key, value in rates.items():
                if key.startswith("perf/") and "_per_s" in key:
                    series[key].append((step, value))
    return series


def is_step_value(key: str) -> bool:
    return key.startswith("train/") and key.endswith("_step")


def is_validation_value(key: str) -> bool:
    return key.startswith("val/")


def is_epoch_value(key: str) -> bool:
    return (key.startswith("train/") and not is_step_value(key)) or key.startswith("perf/")


def quantity(key: str) -> str:
    """The panel of a metric: `train/loss_step`, `train/loss` and `val/loss` all draw `loss`."""
    return re.sub(r"_(step|epoch|best)$", "", key.split("/", 1)[-1])


def plot_series(history: History, title: str) -> Figure:
    """One panel per quantity, every series of that quantity against the step."""
    panels: dict[str, list[str]] = defaultdict(list)
    for key in sorted(history):
        panels[quantity(key)].append(key)
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    figure = Figure(figsize=(4.5 * ncols, 3.2 * nrows), layout="constrained")
    FigureCanvasAgg(figure)  # render with Agg, without pyplot's global state
    figure.suptitle(title)
    for index, (name, keys) in enumerate(panels.items()):
        axes = figure.add_subplot(nrows, ncols, index + 1)
        for key in keys:
            steps, values = zip(*history[key], strict=True)
            marker = None if key.endswith("_step") else "o"
            axes.plot(steps, values, marker=marker, markersize=3, label=key)
        axes.set(title=name, xlabel="step")
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
