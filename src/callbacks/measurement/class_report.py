"""What an image classifier's test got right class by class, as a table and as a picture.

The table is each class's accuracy, the picture the confusion matrix. A no-op for models without
a test confusion matrix (LMs).
"""

import csv
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torchmetrics.classification import MulticlassConfusionMatrix

from src.callbacks.measurement.plots import save_figure
from src.utils.contracts import HasTestConfusionMatrix, NamesClasses

log = logging.getLogger(__name__)

# Past this many classes the cells go unnumbered, and past the second the axes unlabelled:
# they would overlap.
NUMBERED_CLASSES = 16
LABELLED_CLASSES = 60


@dataclass(frozen=True)
class ClassResult:
    """One class's test outcome; `accuracy` is None for a class without test samples."""

    name: str
    samples: int
    correct: int

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.samples if self.samples else None


class ClassReport(Callback):
    """Reports each test of a classifier (`HasTestConfusionMatrix`) class by class.

    At the end of each test:

    - `<dirpath>/per_class_accuracy.csv`: class, samples, correct and accuracy of every class
      (the accuracy left empty for a class without test samples);
    - `<dirpath>/plots/confusion_matrix.png`: test counts, rows the true class, columns the
      predicted one;
    - a table on the console: every class's accuracy, or the `max_rows` worst of more;
    - `accuracy`: {class: accuracy} of the last test, for `metrics.json`.

    Classes are named by the datamodule's `class_names` when it has them (folder and
    torchvision datasets), else by their index. Every rank computes the matrix (torchmetrics
    sums it over the ranks); rank 0 writes and logs.
    """

    def __init__(self, dirpath: str, max_rows: int = 10):
        self.dirpath = Path(dirpath)
        self.max_rows = max_rows
        self.accuracy: dict[str, float | None] = {}

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not isinstance(pl_module, HasTestConfusionMatrix):
            return
        # The matrix HasTestConfusionMatrix promises; nn.Module's __getattr__ types it loosely.
        metric = cast(MulticlassConfusionMatrix, pl_module.test_confusion_matrix)
        confusion = metric.compute().cpu()  # on every rank: it gathers the other ranks' counts
        if confusion.sum() == 0:  # no test batch ran
            return
        names = class_names(trainer.datamodule, len(confusion))  # type: ignore[attr-defined]  # set by Lightning, undeclared on Trainer
        results = class_results(confusion, names)
        self.accuracy = {result.name: result.accuracy for result in results}
        if not trainer.is_global_zero:
            return
        table_path = self.dirpath / "per_class_accuracy.csv"
        write_csv(results, table_path)
        figure_path = self.dirpath / "plots" / "confusion_matrix.png"
        save_figure(plot_confusion_matrix(metric, confusion, names), figure_path)
        table = console_table(results, self.max_rows, table_path)
        log.info("%s\nConfusion matrix: %s", table, figure_path)


def class_names(datamodule: Any, num_classes: int) -> list[str]:
    """The datamodule's names of the classes when it has one per class, else the indices."""
    names = datamodule.class_names if isinstance(datamodule, NamesClasses) else None
    if names and len(names) == num_classes:
        return list(names)
    return [str(index) for index in range(num_classes)]


def class_results(confusion: torch.Tensor, names: list[str]) -> list[ClassResult]:
    """Per class: its test samples (the row's sum) and those predicted right (the diagonal)."""
    samples, correct = confusion.sum(dim=1).tolist(), confusion.diagonal().tolist()
    return [ClassResult(*row) for row in zip(names, samples, correct, strict=True)]


def write_csv(results: list[ClassResult], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["class", "samples", "correct", "accuracy"])
        for result in results:
            accuracy = "" if result.accuracy is None else f"{result.accuracy:.6f}"
            writer.writerow([result.name, result.samples, result.correct, accuracy])


def console_table(results: list[ClassResult], max_rows: int, table_path: Path) -> str:
    """Every class in order, or the `max_rows` worst (lowest accuracy first) of more."""
    shown = results
    title = f"Test accuracy per class ({table_path}):"
    if len(results) > max_rows:
        shown = sorted(results, key=lambda r: (r.accuracy is None, r.accuracy or 0.0))[:max_rows]
        title = f"Test accuracy of the {max_rows} worst of {len(results)} classes ({table_path}):"
    width = max(len("class"), *(len(result.name) for result in shown))
    lines = [title, f"  {'class':<{width}}  accuracy  correct/samples"]
    for result in shown:
        accuracy = "n/a" if result.accuracy is None else f"{result.accuracy:.4f}"
        lines.append(f"  {result.name:<{width}}  {accuracy:>8}  {result.correct}/{result.samples}")
    return "\n".join(lines)


def plot_confusion_matrix(
    metric: MulticlassConfusionMatrix, confusion: torch.Tensor, names: list[str]
) -> Figure:
    """The counts drawn by torchmetrics, on a figure that grows with the number of classes."""
    num_classes = len(names)
    side = min(4 + 0.35 * num_classes, 30)
    figure = Figure(figsize=(side + 1, side), layout="constrained")
    FigureCanvasAgg(figure)  # render with Agg, without pyplot's global state
    axes = figure.add_subplot()
    metric.plot(confusion, ax=axes, add_text=num_classes <= NUMBERED_CLASSES, labels=names)
    figure.colorbar(axes.images[0], ax=axes, shrink=0.8, label="test samples")
    if num_classes > LABELLED_CLASSES:
        axes.set(xticks=[], yticks=[])
    axes.set_title(f"Test confusion matrix ({int(confusion.sum())} samples)")
    return figure
