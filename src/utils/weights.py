"""Weights files read without running code, and a clear diagnosis when they do not fit a network.

The files are torch checkpoints, loaded weights-only, and safetensors.

On the ground floor because every layer reads weights: models their starting weights
(`model.pretrained`), the checkpoints package whole runs.
"""

import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from src.utils.errors import CheckpointError, MissingFileError, first_line

PREFIX = "net."  # the LightningModule attribute holding the network


# What a file is, by its first bytes.
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since PyTorch 1.6
PICKLE_MAGIC = b"\x80"  # the legacy torch.save format starts with a pickle protocol byte


def is_safetensors(head: bytes) -> bool:
    """safetensors: an 8-byte little-endian header length, then the JSON header."""
    return len(head) > 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") > 1


def load_checkpoint(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    """torch.load with `weights_only=True`: tensors and plain Python values, never code.

    A file that is not a torch checkpoint is named for what it is, with what to pass instead.
    """
    path = Path(path)
    if path.is_dir():
        found = [*path.glob("*.ckpt"), *path.glob("checkpoints/*.ckpt")]
        example = min(found, key=lambda p: (p.name != "last.ckpt", str(p)), default=None)
        raise CheckpointError(
            f"{path} is a folder, not a checkpoint file: pass one of its checkpoints"
            + (f", e.g. {example}." if example else "; it holds no .ckpt file.")
        )
    if not path.is_file():
        raise MissingFileError(f"Checkpoint {str(path)!r} does not exist.")
    with path.open("rb") as file:
        head = file.read(16)
    if is_safetensors(head):
        raise CheckpointError(
            f"{path} is a safetensors weights file, not a checkpoint of a training run: it holds "
            f"no optimizer, loop or config state. Start training from its weights with "
            f"model.pretrained={path}; to resume, evaluate or export, pass a .ckpt written by "
            f"train.py (logs/train/runs/<run>/checkpoints/)."
        )
    if not head.startswith((ZIP_MAGIC, PICKLE_MAGIC)):
        kind = "an empty file" if not head else f"a file starting with bytes {head[:8]!r}"
        raise CheckpointError(
            f"{path} is not a PyTorch checkpoint ({kind}). Pass a .ckpt written by train.py "
            f"(logs/train/runs/<run>/checkpoints/last.ckpt)."
        )
    try:
        # mmap: a large checkpoint is paged in as read, not copied into memory up front;
        # only the zip format can be mapped.
        mmap = head.startswith(ZIP_MAGIC)
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"Refusing to load {path}: it holds pickled Python objects, not only tensors and "
            f"plain values ({unpickler_reason(error)}). Unpickling them could run arbitrary "
            f"code. If you trust the file's origin, re-save its tensors (e.g. its state_dict) "
            f"as .safetensors."
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as error:
        # A cut zip fails in whichever reader reaches the gap first: the zip index
        # (RuntimeError), the unpickler (EOFError) or mmap past the end (OSError EINVAL).
        raise _corrupt(path, error) from None


def unpickler_reason(error: pickle.UnpicklingError) -> str:
    """What torch's weights-only unpickler refused, without its advice to load the file unsafely.

    That advice (`weights_only=False`) is the load this template exists to avoid.
    """
    for line in str(error).splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].strip()
    return "not plain data"


def _corrupt(path: Path, error: Exception) -> CheckpointError:
    reason = first_line(error).split(". ")[0]
    if isinstance(error, OSError):
        reason = f"it ends early, at {path.stat().st_size} bytes ({reason})"
    return CheckpointError(
        f"{path} is not a readable checkpoint (truncated or corrupt: {reason}). Use another "
        f"one, e.g. an earlier checkpoint from the same folder."
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
    with path.open("rb") as file:
        head = file.read(16)
    if is_safetensors(head):
        try:
            return load_file(path)
        except SafetensorError as error:
            raise _corrupt(path, error) from None
    if path.suffix == ".safetensors":
        raise CheckpointError(
            f"model.pretrained={str(path)!r} is named .safetensors but is not a safetensors "
            f"file (it starts with bytes {head[:8]!r}): pass the weights file itself."
        )
    if path.suffix in (".ckpt", ".pt", ".pth"):
        return network_state_dict(load_checkpoint(path))
    raise CheckpointError(
        f"model.pretrained={str(path)!r}: unknown format; use .safetensors, .ckpt, .pt or .pth."
    )


def describe_mismatch(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor]) -> str:
    """Which keys are missing, unexpected or of another shape; empty when all fit.

    A module's extra state (`get_extra_state`, e.g. a random generator's) has no fixed shape.
    """
    missing = sorted(f"{key} {_shape(expected[key])}" for key in expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    mismatched = [
        f"{key}: file {list(found[key].shape)}, model {list(expected[key].shape)}"
        for key in sorted(expected.keys() & found.keys())
        if not key.endswith("._extra_state") and found[key].shape != expected[key].shape
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


def _shape(value: object) -> list[int] | str:
    return list(value.shape) if isinstance(value, torch.Tensor) else "(extra state)"
