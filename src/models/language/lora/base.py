"""The frozen base under LoRA adapters, as checkpoints name it: by path and `fingerprint`.

Checkpoints name it instead of holding a second copy of its weights, which come back from that
folder on loading.
"""

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from src.models.language.lora.injection import is_adapter_key, plain_key
from src.models.language.qwen import QwenLM
from src.models.language.qwen.transformers_format.folders import (
    check_same_architecture,
    read_hf_weights,
    weight_files,
)
from src.utils.errors import CheckpointError, MissingFileError

BASE_KEY = "adapter_base"  # the checkpoint entry naming the base
NETWORK_PREFIX = "net."  # the LanguageModel attribute holding the QwenLM
# The state dicts of a Lightning checkpoint: the weights, and the raw ones that the EMA
# callback moves aside when it stores the averaged weights as `state_dict`.
STATE_KEYS = ("state_dict", "current_model_state")
# How much of each tensor the fingerprint reads: its first, middle and last bytes.
SAMPLE_BYTES = 4096
FINGERPRINT_SCHEME = "sha256 of safetensors headers and 3 x 4 KiB of every tensor"


def fingerprint(folder: str | Path) -> str:
    """A cheap identity of a transformers folder's weights, for multi-GB checkpoints too.

    It is a sha256 of every safetensors header (names, dtypes, shapes, offsets) and of the
    first, middle and last 4 KiB of every tensor, so that another checkpoint of the same
    architecture (fine-tuned, merged, re-initialised) differs. Not a full hash: it reads a few MB.
    """
    digest = hashlib.sha256()
    for file in weight_files(Path(folder)):
        with file.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = handle.read(size)
            digest.update(file.name.encode() + header)
            tensors = {k: v for k, v in json.loads(header).items() if k != "__metadata__"}
            for name in sorted(tensors):
                start, end = tensors[name]["data_offsets"]
                middle = (start + end) // 2
                for offset in sorted({start, max(start, middle - SAMPLE_BYTES // 2)}):
                    handle.seek(8 + size + offset)
                    digest.update(handle.read(min(SAMPLE_BYTES, end - offset)))
                handle.seek(8 + size + max(start, end - SAMPLE_BYTES))
                digest.update(handle.read(min(SAMPLE_BYTES, end - start)))
    return digest.hexdigest()


def base_identity(folder: str | Path) -> dict[str, str]:
    """What a checkpoint records of its base: the folder's absolute path and fingerprint."""
    return {
        "path": str(Path(folder).resolve()),
        "fingerprint": fingerprint(folder),
        "scheme": FINGERPRINT_SCHEME,
    }


def is_base_key(key: str) -> bool:
    """A LanguageModel state-dict key of the frozen base (`net.`, not an adapter)."""
    return key.startswith(NETWORK_PREFIX) and not is_adapter_key(key)


def strip_base(checkpoint: dict[str, Any], base: dict[str, str]) -> None:
    """Drop the frozen base's weights from a Lightning checkpoint, in place, and name the base.

    Which base it was goes into `checkpoint["adapter_base"]`.
    """
    for name in STATE_KEYS:
        if isinstance(state := checkpoint.get(name), dict):
            for key in [k for k in state if is_base_key(k)]:
                del state[key]
    checkpoint[BASE_KEY] = dict(base)


def load_recorded_base(net: QwenLM, recorded: Mapping[str, str]) -> dict[str, str]:
    """Load the base that a checkpoint names into `net`; return its identity as it is now.

    `net` is a model rebuilt without `model.pretrained`.
    """
    folder = Path(recorded["path"])
    if not (folder / "config.json").is_file():
        raise MissingFileError(
            f"This checkpoint holds LoRA adapters on the base {folder} (the checkpoint's "
            f"{BASE_KEY}.path, from the run's model.pretrained), which is no longer there: put "
            f"the base back, or give its new place with model.pretrained=<folder> (eval.py, "
            f"scripts/export.py) or --base <folder> (scripts/generate.py)."
        )
    load_base(net, folder)
    return base_identity(folder)


def check_same_base(base: Mapping[str, str], recorded: Mapping[str, str]) -> None:
    """Refuse a model whose base is not the one a checkpoint's adapters were trained on."""
    if base["fingerprint"] != recorded["fingerprint"]:
        raise CheckpointError(
            f"This checkpoint holds LoRA adapters trained on the base {recorded['path']} "
            f"(fingerprint {recorded['fingerprint'][:16]}...), but the model's base "
            f"{base['path']} has fingerprint {base['fingerprint'][:16]}...: "
            f"adapters only fit the weights they were trained on. Set model.pretrained to "
            f"that base."
        )


def complete_state_dict(checkpoint: dict[str, Any], own: Mapping[str, torch.Tensor]) -> None:
    """Put the base's weights back into an adapter checkpoint's state dicts, in place.

    The weights come from `own`, the LanguageModel's state dict, after checking that the
    checkpoint's state dicts hold every other key.
    """
    for name in STATE_KEYS:
        if not isinstance(state := checkpoint.get(name), dict):
            continue
        if absent := [k for k in own if k not in state and not is_base_key(k)]:
            raise CheckpointError(
                f"The adapter checkpoint's {name} lacks weights that it should hold: "
                f"{absent[:8]}{' ...' if len(absent) > 8 else ''}."
            )
        state.update({k: v for k, v in own.items() if is_base_key(k) and k not in state})


def load_base(net: QwenLM, folder: str | Path) -> None:
    """Load a transformers folder's weights under `net`'s adapters.

    peft renames an adapted `x.weight` to `x.base_layer.weight` (an adapted expert weight
    `experts.base_layer.base_layer.down_proj`).
    """
    check_same_architecture(net.config, folder)
    names = {plain_key(key): key for key in net.state_dict() if not is_adapter_key(key)}
    own = net.state_dict()
    expected = {plain: own[key] for plain, key in names.items()}
    state = read_hf_weights(folder, expected)
    net.load_state_dict({names[plain]: value for plain, value in state.items()}, strict=False)
