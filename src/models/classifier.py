"""The LightningModule that trains any image classifier network with cross-entropy."""

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification import MulticlassAccuracy

OptimizerFactory = Callable[..., torch.optim.Optimizer]


class ImageClassifier(LightningModule):
    """Cross-entropy training, accuracy per stage and the best validation accuracy so far.

    `optimizer` is a partial optimizer (`_partial_: true` in config) called with the trainable
    parameters. `scheduler` is Lightning's lr-scheduler dict whose `scheduler` entry is a partial
    called with the optimizer, e.g. `{"scheduler": partial(CosineAnnealingLR, T_max=10),
    "interval": "epoch"}`. Only plain values reach the checkpoint's hyperparameters, so
    checkpoints load with `torch.load(..., weights_only=True)`.
    """

    def __init__(
        self,
        net: nn.Module,
        num_classes: int,
        optimizer: OptimizerFactory,
        scheduler: dict[str, Any] | None = None,
    ):
        super().__init__()
        self.save_hyperparameters(ignore=["net", "optimizer", "scheduler"], logger=False)
        self.net = net
        self.optimizer_factory = optimizer
        self.scheduler_config = scheduler
        self.criterion = nn.CrossEntropyLoss()
        self.train_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")
        self.train_loss, self.val_loss, self.test_loss = MeanMetric(), MeanMetric(), MeanMetric()
        self.val_acc_best = MaxMetric()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def on_train_start(self) -> None:
        # The sanity check's few batches must not count towards the best validation accuracy.
        self.val_acc.reset()
        self.val_loss.reset()
        self.val_acc_best.reset()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        loss, preds, targets = self._shared_step(batch)
        self.train_loss(loss)
        self.train_acc(preds, targets)
        # Per-step loss, written every `trainer.log_every_n_steps` like a classic training loop.
        self.log("train/loss_step", loss, on_step=True, on_epoch=False)
        self.log("train/loss", self.train_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss, preds, targets = self._shared_step(batch)
        self.val_loss(loss)
        self.val_acc(preds, targets)
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("val/acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        self.val_acc_best(self.val_acc.compute())
        self.log("val/acc_best", self.val_acc_best.compute(), sync_dist=True, prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss, preds, targets = self._shared_step(batch)
        self.test_loss(loss)
        self.test_acc(preds, targets)
        self.log("test/loss", self.test_loss, on_step=False, on_epoch=True)
        self.log("test/acc", self.test_acc, on_step=False, on_epoch=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs = batch[0] if isinstance(batch, list | tuple) else batch
        return self(inputs).argmax(dim=1)

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        optimizer = self.optimizer_factory(params)
        if not self.scheduler_config:
            return optimizer
        lr_scheduler = dict(self.scheduler_config)
        lr_scheduler["scheduler"] = lr_scheduler["scheduler"](optimizer)
        return {"optimizer": optimizer, "lr_scheduler": lr_scheduler}

    def _shared_step(self, batch: tuple[torch.Tensor, torch.Tensor]):
        inputs, targets = batch
        logits = self(inputs)
        loss = self.criterion(logits, targets)
        return loss, logits.argmax(dim=1), targets
