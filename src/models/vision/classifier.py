"""The LightningModule that trains any image classifier network with cross-entropy."""

from typing import Any

import torch
from torch import nn
from torchmetrics import MaxMetric, MeanMetric, Metric
from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix

from src.models.optimization import OptimizedModule, OptimizerFactory
from src.utils.contracts import IMAGES
from src.utils.lightning import is_logging_step
from src.utils.weights import load_network_weights

STAGES = ("train", "val", "test")


class ImageClassifier(OptimizedModule):
    """Cross-entropy training, accuracy per stage and the best validation accuracy so far.

    The test loop also fills `test_confusion_matrix` (rows: true class, columns: predicted),
    for reports of the last test such as `src/callbacks/measurement/class_report.py`.

    `optimizer` is a partial optimizer (`_partial_: true` in config) called with the trainable
    parameters, all in one group. `scheduler` is Lightning's lr-scheduler dict whose `scheduler`
    entry is a partial called with the optimizer, e.g. `{"scheduler": partial(CosineAnnealingLR,
    T_max=10), "interval": "epoch"}` (`src/models/optimization.py`). `pretrained` starts the
    network from a weights file (see `src/utils/weights.py`). Only plain values reach the
    checkpoint's hyperparameters, so checkpoints load with `torch.load(..., weights_only=True)`.
    """

    batch_kind = IMAGES

    def __init__(
        self,
        net: nn.Module,
        num_classes: int,
        optimizer: OptimizerFactory,
        scheduler: dict[str, Any] | None = None,
        pretrained: str | None = None,
        input_shape: list[int] | None = None,
    ):
        super().__init__(optimizer, scheduler)
        if input_shape is not None:
            input_shape = [int(size) for size in input_shape]  # a plain list in checkpoints
        self.save_hyperparameters(
            ignore=["net", "optimizer", "scheduler", "pretrained"], logger=False
        )
        if pretrained:
            load_network_weights(net, pretrained)
        self.net = net
        if input_shape is not None:  # one sample's shape: the model graph and summary use it
            self.example_input_array = torch.zeros(1, *input_shape)
        self.criterion = nn.CrossEntropyLoss()
        # One accuracy and one mean loss per stage, updated every step and logged once per epoch:
        # one `self.log` call per step costs more than a small model's whole step (BENCHMARKS.md).
        # Persistent metric states go into checkpoints, so an epoch interrupted by a crash
        # resumes with its running sums and logs exactly what the uninterrupted run would.
        for stage in STAGES:
            accuracy = MulticlassAccuracy(num_classes, average="micro", validate_args=False)
            setattr(self, f"{stage}_acc", accuracy)
            setattr(self, f"{stage}_loss", MeanMetric())
        self.val_acc_best = MaxMetric()
        for metric in self.modules():
            if isinstance(metric, Metric):
                metric.persistent(True)
        # Not in checkpoints: a test is never resumed, the states grow as num_classes squared,
        # and checkpoints written before it existed still load strictly.
        self.test_confusion_matrix = MulticlassConfusionMatrix(num_classes, validate_args=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def metric_keys(self) -> set[str]:
        """The metrics this module logs (src/run/metric_keys.py checks monitors against them)."""
        return {"train/loss_step", "val/acc_best"} | {
            f"{stage}/{name}" for stage in STAGES for name in ("loss", "acc")
        }

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        loss, _ = self._shared_step("train", batch)
        # The step loss, on logging steps only (`trainer.log_every_n_steps`), as a classic loop.
        if is_logging_step(self.trainer):
            self.log("train/loss_step", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._shared_step("val", batch)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        _, predictions = self._shared_step("test", batch)
        self.test_confusion_matrix.update(predictions, batch[1])

    def on_train_epoch_end(self) -> None:
        self._log_epoch("train")

    def on_validation_epoch_end(self) -> None:
        acc = self._log_epoch("val")
        if not self.trainer.sanity_checking:  # a few sanity batches are not a validation
            self.val_acc_best(acc)
            self.log("val/acc_best", self.val_acc_best.compute(), prog_bar=True, sync_dist=True)

    def on_test_epoch_start(self) -> None:
        # Reset here, not at the epoch's end: the matrix outlives the test for its reports.
        self.test_confusion_matrix.reset()

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs = batch[0] if isinstance(batch, list | tuple) else batch
        return self(inputs).argmax(dim=1)

    def _shared_step(
        self, stage: str, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's loss and predicted classes, counted in the stage's metrics."""
        inputs, targets = batch
        logits = self(inputs)
        loss = self.criterion(logits, targets)
        predictions = logits.argmax(dim=1)
        getattr(self, f"{stage}_acc").update(predictions, targets)
        getattr(self, f"{stage}_loss").update(loss.detach(), weight=len(targets))
        return loss, predictions

    def _log_epoch(self, stage: str) -> torch.Tensor:
        """Log the stage's epoch loss and accuracy, then reset.

        `compute()` already gathers the states of every rank, so all ranks log the same value;
        `sync_dist` only tells Lightning so (one all-reduce per epoch, not per step).
        """
        acc = getattr(self, f"{stage}_acc").compute()
        loss = getattr(self, f"{stage}_loss").compute()
        self.log(f"{stage}/loss", loss, prog_bar=stage != "test", sync_dist=True)
        self.log(f"{stage}/acc", acc, prog_bar=stage != "test", sync_dist=True)
        self._reset(stage)
        return acc

    def _reset(self, stage: str) -> None:
        getattr(self, f"{stage}_acc").reset()
        getattr(self, f"{stage}_loss").reset()
