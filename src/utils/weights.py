"""Weights files read without running code: torch checkpoints loaded weights-only, safetensors,
and a clear diagnosis when the weights do not fit a network.

On the ground floor because every layer reads weights: models their starting weights
(`model.pretrained`), the checkpoints package whole runs.
"""

import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from src.utils.errors import CheckpointError, MissingFileError

PREFIX = "net."  # the LightningModule attribute holding the network


def load_checkpoint(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    """torch.load with `weights_only=True`: tensors and plain Python values, never code."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"Checkpoint {str(path)!r} does not exist.")
    try:
        # mmap: a large checkpoint is paged in as read, not copied into memory up front.
        return torch.load(path, map_location=map_location, weights_only=True, mmap=True)
    except RuntimeError as error:
        if "mmap" not in str(error):  # only files in the legacy (non-zip) format need this
            raise _corrupt(path, error) from None
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        reason = str(error).split("\n")[0]
        raise CheckpointError(
            f"Refusing to load {path}: it holds pickled Python objects, not only tensors and "
            f"plain values ({reason}). Unpickling them could run arbitrary code. If you trust "
            f"the file's origin, re-save its tensors (e.g. its state_dict) as .safetensors."
        ) from None
    except (EOFError, zipfile.BadZipFile) as error:
        raise _corrupt(path, error) from None


def _corrupt(path: Path, error: Exception) -> CheckpointError:
    return CheckpointError(
        f"{path} is not a readable checkpoint (truncated or corrupt: "
        f"{str(error).splitlines()[0]}). Use another one, e.g. an earlier checkpoint from the "
        f"same folder."
    )


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
