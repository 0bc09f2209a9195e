"""Exponential moving average of the weights (`callbacks=[default,ema]`)."""

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import EMAWeightAveraging


class EMA(EMAWeightAveraging):
    """Lightning's `EMAWeightAveraging`, whose averaged weights are also tested after fitting.

    Lightning keeps the average once `fit` is over, so `trainer.test(ckpt_path=...)` in the same
    process (train.py) would otherwise load the checkpoint's raw weights (`current_model_state`)
    instead of the averaged `state_dict`.
    """

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._average_model = None

    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Outside fitting there is no average to restore: `state_dict` holds the averaged weights.
        if self._average_model is not None:
            super().on_load_checkpoint(trainer, pl_module, checkpoint)
