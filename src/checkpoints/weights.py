"""Check whole checkpoints against a model, and write weights out.

The reading half lives in src/utils/weights.py.
"""

from pathlib import Path

import torch
from lightning.pytorch import LightningModule
from safetensors.torch import save_file
from torch import nn

from src.utils.errors import CheckpointError
from src.utils.weights import describe_mismatch, load_checkpoint


def check_checkpoint_fits(model: nn.Module, checkpoint_path: str | Path) -> None:
    """Fail before training when a checkpoint was written for another model or data shape."""
    checkpoint = load_checkpoint(checkpoint_path)
    if isinstance(model, LightningModule):
        # As Trainer does before loading: a LoRA run's checkpoint gets its base back there.
        model.on_load_checkpoint(checkpoint)
    if problems := describe_mismatch(model.state_dict(), checkpoint.get("state_dict", {})):
        trained = checkpoint.get("run_config", {}).get("overrides")
        origin = f" It was written by a run with overrides {trained}." if trained else ""
        raise CheckpointError(
            f"{checkpoint_path} is a checkpoint of another model: {problems}.{origin} Resume "
            f"with the same model and data options, or start from its weights with "
            f"model.pretrained=... where they fit."
        )


def save_weights(state: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write weights as .safetensors or a weights-only .pt state dict, by suffix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Own, contiguous storage per tensor: safetensors refuses shared (e.g. tied) tensors.
    tensors = {key: value.detach().contiguous().clone() for key, value in state.items()}
    if path.suffix == ".safetensors":
        save_file(tensors, path)
    else:
        torch.save(tensors, path)
