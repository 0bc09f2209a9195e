"""Network weights in and out: read any common weights file, load it with a clear diagnosis."""

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from src.checkpoints.io import load_checkpoint
from src.utils.errors import CheckpointError, MissingFileError

PREFIX = "net."  # the LightningModule attribute holding the network


def network_state_dict(checkpoint: dict) -> dict[str, torch.Tensor]:
    """The network's weights from a Lightning checkpoint (or a bare state dict), unprefixed."""
    state = checkpoint.get("state_dict", checkpoint)
    if any(key.startswith(PREFIX) for key in state):
        return {k.removeprefix(PREFIX): v for k, v in state.items() if k.startswith(PREFIX)}
    return dict(state)


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Weights from a .safetensors file, a Lightning .ckpt, or a .pt/.pth state dict."""
    path = Path(path)
    if path.is_dir() and (path / "model.safetensors").is_file():
        path = path / "model.safetensors"
    if not path.is_file():
        raise MissingFileError(f"model.pretrained={str(path)!r} does not exist.")
    if path.suffix == ".safetensors":
        return load_file(path)
    if path.suffix in (".ckpt", ".pt", ".pth"):
        return network_state_dict(load_checkpoint(path))
    raise CheckpointError(
        f"model.pretrained={str(path)!r}: unknown format; use .safetensors, .ckpt, .pt or .pth."
    )


def describe_mismatch(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor]) -> str:
    """Which keys are missing, unexpected or of another shape; empty when all fit."""
    missing = sorted(f"{key} {list(expected[key].shape)}" for key in expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    mismatched = [
        f"{key}: file {list(found[key].shape)}, model {list(expected[key].shape)}"
        for key in sorted(expected.keys() & found.keys())
        if found[key].shape != expected[key].shape
    ]
    problems = [
        f"{label} ({len(items)}): {', '.join(items[:8])}{' ...' if len(items) > 8 else ''}"
        for label, items in (
            ("missing in the file", missing),
            ("not in the model", unexpected),
            ("shape mismatch", mismatched),
        )
        if items
    ]
    return "; ".join(problems)


def load_network_weights(net: nn.Module, path: str | Path) -> None:
    """Load `path` into `net`, or say exactly which keys and shapes do not fit."""
    state = read_weights(path)
    if problems := describe_mismatch(net.state_dict(), state):
        raise CheckpointError(
            f"The weights in {path} do not fit {type(net).__name__}: {problems}. "
            f"Was the file written for another model or data shape?"
        )
    net.load_state_dict(state)


def check_checkpoint_fits(model: nn.Module, checkpoint_path: str | Path) -> None:
    """Fail before training when a checkpoint was written for another model or data shape."""
    checkpoint = load_checkpoint(checkpoint_path)
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
