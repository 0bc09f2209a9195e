"""The learning-rate range test before training (`+tune=lr_find`): suggest, apply and plot."""

from pathlib import Path

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import LearningRateFinder
from lightning.pytorch.tuner.lr_finder import _LRFinder
from lightning.pytorch.utilities import rank_zero_info
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from src.callbacks.measurement.plots import save_figure


class LRFinder(LearningRateFinder):
    """Lightning's `LearningRateFinder` for modules that keep the learning rate in their config.

    The rate is in their optimizer config rather than in an `lr` attribute (as `ImageClassifier`
    does).

    Before fitting, the range test trains `num_training_steps` steps at rates rising from `min_lr`
    to `max_lr`, then restores the weights. The suggestion (steepest loss descent) is printed,
    drawn in `<dirpath>/lr_find.png` and, with `update_lr`, written into the optimizer and the
    schedulers' base rates, so training starts from it. A resumed run skips the test.
    """

    def __init__(self, dirpath: str, update_lr: bool = True, **finder_args):
        super().__init__(update_attr=False, **finder_args)
        self.dirpath = Path(dirpath)
        self.update_lr = update_lr

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.ckpt_path is not None:
            # The checkpoint's optimizer state would replace the suggestion anyway.
            rank_zero_info(
                "Learning-rate finder skipped: a resumed run keeps the learning rate it had."
            )
            return
        super().on_fit_start(trainer, pl_module)

    def lr_find(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().lr_find(trainer, pl_module)
        if self.optimal_lr is None:  # skipped under fast_dev_run
            return
        finder = self.optimal_lr
        suggestion = finder.suggestion()
        if suggestion is not None and self.update_lr:
            set_learning_rate(trainer, suggestion)
        if trainer.is_global_zero:
            path = self.dirpath / "lr_find.png"
            self.plot(finder, path, suggestion)
            applied = " (applied)" if self.update_lr and suggestion is not None else ""
            rank_zero_info(f"Learning-rate finder: suggested lr {suggestion}{applied}; plot {path}")

    def plot(self, finder: _LRFinder, path: Path, suggestion: float | None) -> None:
        figure = Figure(figsize=(6, 4), layout="constrained")
        FigureCanvasAgg(figure)  # render with Agg, without pyplot's global state
        axes = figure.add_subplot()
        finder.plot(suggest=True, ax=axes)
        suggested = "no suggestion" if suggestion is None else f"suggested lr {suggestion:.3g}"
        axes.set_title(f"Learning-rate range test: {suggested}")
        save_figure(figure, path)


def set_learning_rate(trainer: Trainer, lr: float) -> None:
    """Train from `lr`: every parameter group, and the base rates schedulers start from."""
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr
            if "initial_lr" in group:
                group["initial_lr"] = lr
    for config in trainer.lr_scheduler_configs:
        if hasattr(config.scheduler, "base_lrs"):
            config.scheduler.base_lrs = [lr] * len(config.scheduler.base_lrs)
