"""Keep the run's resolved config and command-line overrides inside every checkpoint."""

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


class RunConfigInCheckpoint(Callback):
    """Adds `checkpoint["run_config"] = {"config": ..., "overrides": [...]}` on every save.

    Both are plain Python containers, so the checkpoint still loads with `weights_only=True`;
    `eval.py` uses them to rebuild exactly the model that produced the weights.
    """

    def __init__(self, config: dict[str, Any], overrides: list[str]):
        self.run_config = {"config": config, "overrides": list(overrides)}

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint["run_config"] = self.run_config
