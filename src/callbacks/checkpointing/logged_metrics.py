"""Keep the metrics a fit has logged so far in its checkpoints, and give them back on resume.

Lightning forgets its callback metrics between processes: a run resumed from its final
checkpoint (killed while testing, say) trains no step, and its metrics.json would lose every
training and validation metric; a run resumed mid-fit would monitor a validation loss that is
not there until its next validation. The uninterrupted run has them all the way, so the resumed
one gets them back before its fit starts.
"""

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer


class LoggedMetricsInCheckpoint(Callback):
    """Saves `trainer.callback_metrics` as `checkpoint["callback_metrics"]`; restores them."""

    def __init__(self) -> None:
        self.restored: dict[str, Any] = {}

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint["callback_metrics"] = {
            key: value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
            for key, value in trainer.callback_metrics.items()
        }

    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self.restored = dict(checkpoint.get("callback_metrics", {}))  # none in older checkpoints

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning clears its metrics after restoring the callbacks and again after a sanity
        # check; the property returns its live dict, which logging updates from here on.
        trainer.callback_metrics.update(self.restored)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Give back what this fit did not log anew.

        A fit resumed from its final checkpoint trains no step, so `on_train_start` never ran.
        """
        for key, value in self.restored.items():
            trainer.callback_metrics.setdefault(key, value)
        self.restored = {}
