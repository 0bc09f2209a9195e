"""A trained model and its datamodule rebuilt from a checkpoint, for use outside the Trainer.

The checkpoint's stored run config says which classes to build; the weights and the datamodule's
state (e.g. class names) come from the checkpoint itself. Nothing here reads the dataset.
"""

from pathlib import Path

import hydra
from lightning.pytorch import LightningDataModule, LightningModule

from src.checkpoints.io import load_checkpoint
from src.utils.errors import CheckpointError


def load_trained(ckpt_path: str | Path) -> tuple[LightningModule, LightningDataModule]:
    """The model (in eval mode, on the CPU) and the datamodule of a checkpoint from train.py."""
    checkpoint = load_checkpoint(ckpt_path)
    stored = checkpoint.get("run_config")
    if stored is None:
        raise CheckpointError(
            f"{ckpt_path} records no run config, so the model it holds cannot be rebuilt. Use a "
            f"checkpoint written by train.py (e.g. <run dir>/checkpoints/last.ckpt)."
        )
    config = stored["config"]
    model_config = dict(config["model"])
    if "pretrained" in model_config:  # the weights the run started from: replaced just below
        model_config["pretrained"] = None
    model = hydra.utils.instantiate(model_config)
    model.load_state_dict(checkpoint["state_dict"])
    datamodule = hydra.utils.instantiate(config["data"])
    datamodule.load_state_dict(checkpoint.get(type(datamodule).__qualname__, {}))
    return model.eval(), datamodule
