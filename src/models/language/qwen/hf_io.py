"""Read and write transformers-format folders: config.json plus safetensors weights (never pickle),
in one file or in shards listed by an index.

What the names and keys mean on either side is the state-dict adapter's (state_dict_adapter.py);
this module reads and writes the files and checks that every key and shape fits.
"""

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from src.models.language.qwen.config import QwenConfig
from src.models.language.qwen.state_dict_adapter import ADAPTERS, adapter_for
from src.utils.errors import CheckpointError, ConfigError, MissingFileError
from src.utils.weights import describe_mismatch


def config_from_hf(values: dict[str, Any]) -> QwenConfig:
    """QwenConfig from a transformers config.json, or a ConfigError saying why the checkpoint
    is not one this model can run."""
    model_type = values.get("model_type")
    if model_type not in ADAPTERS:
        raise ConfigError(
            f"config.json has model_type={model_type!r}; QwenLM loads {sorted(ADAPTERS)}"
        )
    return QwenConfig(**ADAPTERS[model_type].config_from_hf(values))


def check_same_architecture(config: QwenConfig, directory: str | Path) -> None:
    """ConfigError naming every field where `config` and the folder's config.json disagree
    (the Gated DeltaNet block length aside: it changes no result)."""
    ours, theirs = config.to_dict(), read_hf_config(directory).to_dict()
    differing = [
        f"{name} ({ours[name]!r} here, {theirs[name]!r} there)"
        for name in ours
        if name != "linear_chunk_size" and ours[name] != theirs[name]
    ]
    if differing:
        raise ConfigError(
            f"The model config differs from {Path(directory) / 'config.json'}: "
            f"{'; '.join(differing)}. Make the model config match the checkpoint."
        )


def read_hf_config(directory: str | Path) -> QwenConfig:
    """The QwenConfig of a transformers folder's config.json."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise MissingFileError(f"{path} not found: expected a transformers-format model folder")
    return config_from_hf(json.loads(path.read_text()))


def read_hf_weights(
    directory: str | Path, expected: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The folder's weights as the model's state dict, checked against `expected` (that state
    dict, shapes only) in the folder's own names, as its config.json's model type names them.

    Reads model.safetensors, or the shards listed in model.safetensors.index.json. Raises a
    CheckpointError naming every missing, unexpected or misshapen key.
    """
    directory = Path(directory)
    adapter = adapter_for(read_hf_config(directory))
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(directory):
        tensors.update(load_file(file))
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
) -> None:
    """config.json and model.safetensors, or shards of at most `max_shard_bytes` plus an index,
    for a model of `config` with weights `state_dict`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    adapter = adapter_for(config)
    tensors = {key: t.detach().contiguous() for key, t in adapter.to_hf(state_dict).items()}
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    hf_config = {**adapter.config_to_hf(config), "torch_dtype": dtype}
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


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int | None) -> list[dict]:
    """Consecutive groups of tensors of at most `max_bytes` each (a larger tensor stands alone)."""
    shards, size = [{}], 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_bytes is not None and shards[-1] and size + nbytes > max_bytes:
            shards, size = [*shards, {}], 0
        shards[-1][key] = tensor
        size += nbytes
    return shards
