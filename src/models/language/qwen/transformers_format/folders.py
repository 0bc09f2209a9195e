"""Read and write transformers-format folders: config.json plus safetensors weights (never pickle).

The weights are in one file or in shards listed by an index.

What the names and keys mean on either side is the state-dict adapter's (state_dict_adapter.py);
this module reads and writes the files and checks that every key and shape fits. Tensors of a
folder that QwenLM does not use (a vision tower, MTP layers) are never loaded: saving a model
loaded from that folder (its `source`) copies them from there, byte for byte.
"""

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from src.models.language.qwen.config import QwenConfig
from src.models.language.qwen.transformers_format.state_dict_adapter import (
    ADAPTERS,
    QwenStateDictAdapter,
    adapter_for,
)
from src.utils.errors import CheckpointError, ConfigError, MissingFileError
from src.utils.weights import describe_mismatch


def config_from_hf(values: dict[str, Any]) -> QwenConfig:
    """QwenConfig from a transformers config.json.

    Raises a ConfigError saying why when the checkpoint is not one this model can run.
    """
    model_type = values.get("model_type")
    if model_type not in ADAPTERS:
        raise ConfigError(
            f"config.json has model_type={model_type!r}; QwenLM loads {sorted(ADAPTERS)}"
        )
    return QwenConfig(**ADAPTERS[model_type].config_from_hf(values))


# The folder's business, not the math: which layout its files have (within one family) and
# which ids its vision tower fills in. The Gated DeltaNet block length changes no result.
FOLDER_FIELDS = ("model_type", "image_token_id", "video_token_id")
IMPLEMENTATION_FIELDS = ("linear_chunk_size",)


def check_same_architecture(config: QwenConfig, directory: str | Path) -> None:
    """Raise a ConfigError naming every field where `config` and the folder's config.json differ.

    Left aside: the Gated DeltaNet block length, and the fields of FOLDER_FIELDS when both are
    of one family.
    """
    config_for_checkpoint(config, directory, explicit=None)


def folder_layout(config: QwenConfig, recorded: QwenConfig) -> QwenConfig:
    """`config`, in `recorded`'s folder layout where the two differ only in FOLDER_FIELDS.

    A run's stored model config may name the layout it was written with (qwen3_5_text) while
    the model it trained was a multimodal folder's (qwen3_5): same math, other files.
    """
    ours, theirs = config.to_dict(), recorded.to_dict()
    differing = {name for name in ours if ours[name] != theirs[name]}
    if config.family != recorded.family or differing - set(FOLDER_FIELDS):
        return config
    return QwenConfig(**{**ours, **{name: theirs[name] for name in FOLDER_FIELDS}})


def config_for_checkpoint(
    config: QwenConfig, directory: str | Path, explicit: Collection[str] | None
) -> QwenConfig:
    """The QwenConfig to build for the folder's weights: its config.json's, checked against ours.

    `explicit` names the fields the user set (on the command line): a ConfigError names those
    that contradict the folder. None counts every field of `config` as set, so that it must
    match whole. The result takes our `linear_chunk_size`, the folder everything else.
    """
    theirs = read_hf_config(directory)
    ours, folder = config.to_dict(), theirs.to_dict()
    checked = set(ours) if explicit is None else set(explicit) & set(ours)
    checked -= set(IMPLEMENTATION_FIELDS)
    if config.family == theirs.family:
        checked -= set(FOLDER_FIELDS) if explicit is None else {"model_type"}
    differing = [
        f"{name} ({ours[name]!r} here, {folder[name]!r} there)"
        for name in ours
        if name in checked and ours[name] != folder[name]
    ]
    if differing:
        raise ConfigError(
            f"The model config differs from {Path(directory) / 'config.json'}: "
            f"{'; '.join(differing)}. "
            + (
                "Make the model config match the checkpoint."
                if explicit is None
                else "Leave them off the command line to take the folder's."
            )
        )
    return QwenConfig(**{**folder, **{name: ours[name] for name in IMPLEMENTATION_FIELDS}})


def read_hf_config(directory: str | Path) -> QwenConfig:
    """The QwenConfig of a transformers folder's config.json."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise MissingFileError(f"{path} not found: expected a transformers-format model folder")
    return config_from_hf(json.loads(path.read_text()))


def read_hf_weights(
    directory: str | Path, expected: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The folder's weights as the model's state dict, checked against `expected`.

    `expected` is that state dict, of which only the shapes are read; the check is made in the
    folder's own names, as its config.json's model type names them.

    Reads model.safetensors, or the shards listed in model.safetensors.index.json. Raises a
    CheckpointError naming every missing, unexpected or misshapen key.
    """
    directory = Path(directory)
    adapter = adapter_for(read_hf_config(directory))
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(directory):
        with safe_open(file, "pt") as handle:
            for key in handle.keys():  # noqa: SIM118  # a safe_open handle is no dict
                if not adapter.is_unused(key):
                    tensors[key] = handle.get_tensor(key)
    state = adapter.from_hf(tensors)
    if problems := describe_mismatch(adapter.to_hf(expected), adapter.to_hf(state)):
        raise CheckpointError(
            f"The weights in {directory} do not fit the model its config.json describes: "
            f"{problems}."
        )
    return state


def save_hf_directory(
    directory: str | Path,
    config: QwenConfig,
    state_dict: dict[str, torch.Tensor],
    max_shard_bytes: int | None = None,
    source: str | Path | None = None,
) -> None:
    """Write the folder of a model of `config` with weights `state_dict`: config.json, weights.

    The weights go to model.safetensors, or to shards of at most `max_shard_bytes` plus an index.
    `source`, the folder the model was loaded from, supplies what QwenLM does not hold: the
    tensors it never used, as they are there, and the rest of its config.json (a vision
    tower's).
    """
    directory = Path(directory)
    adapter = adapter_for(config)
    original = _source_config(source) if source is not None else None
    hf_config = adapter.config_to_hf(config, original)  # refuses a multimodal model sourceless
    tensors = {key: t.detach().contiguous() for key, t in adapter.to_hf(state_dict).items()}
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    # A folder of another layout (a text-only model saved from a multimodal source) keeps none.
    if source is not None and read_hf_config(source).model_type == config.model_type:
        tensors.update(unused_tensors(source, adapter))
    hf_config = {**hf_config, "torch_dtype": dtype}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def unused_tensors(source: str | Path, adapter: QwenStateDictAdapter) -> dict[str, torch.Tensor]:
    """The tensors of the folder `source` that QwenLM never reads, in their own dtype."""
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(Path(source)):
        with safe_open(file, "pt") as handle:
            for key in handle.keys():  # noqa: SIM118  # a safe_open handle is no dict
                if adapter.is_unused(key):
                    tensors[key] = handle.get_tensor(key)
    return tensors


def _source_config(source: str | Path) -> dict[str, Any]:
    path = Path(source) / "config.json"
    if not path.is_file():
        raise MissingFileError(
            f"{path} not found: this model was loaded from {source}, whose tensors it does not "
            f"use (a vision tower, MTP layers) are written back from there on saving. Put the "
            f"folder back there."
        )
    return json.loads(path.read_text())


def weight_files(directory: Path) -> list[Path]:
    """The folder's safetensors files: model.safetensors, or the shards its index lists."""
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    pickled = sorted(p.name for p in directory.glob("*.bin"))
    hint = f" (found {pickled}: pickle files are never loaded; convert them)" if pickled else ""
    raise MissingFileError(
        f"{directory} has neither model.safetensors nor model.safetensors.index.json{hint}"
    )


def _shards(
    tensors: dict[str, torch.Tensor], max_bytes: int | None
) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most `max_bytes` each (a larger tensor stands alone)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_bytes is not None and shards[-1] and size + nbytes > max_bytes:
            shards, size = [*shards, {}], 0
        shards[-1][key] = tensor
        size += nbytes
    return shards
