"""Read and write transformers-format folders: config.json plus safetensors weights (never pickle).

Parameter names are identical on both sides, so no key is renamed: loading is a check that every
key and shape fits, then an assignment.
"""

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from src.models.language.qwen.config import QwenConfig
from src.utils.errors import CheckpointError, ConfigError, MissingFileError
from src.utils.weights import describe_mismatch

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}

# transformers' class defaults, which stand for any key a config.json leaves out.
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
        "head_dim": 128, "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
        "max_position_embeddings": 32768,
    },
    "qwen3_next": {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
        "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 256, "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
        "max_position_embeddings": 32768, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "num_experts": 512, "full_attention_interval": 4,
    },
}  # fmt: skip
COMMON_DEFAULTS = {
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "initializer_range": 0.02, "hidden_act": "silu", "bos_token_id": None, "eos_token_id": None,
}  # fmt: skip
COPIED_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "head_dim", "rms_norm_eps", "tie_word_embeddings", "attention_bias", "max_position_embeddings",
    "initializer_range", "bos_token_id", "eos_token_id",
)  # fmt: skip
LINEAR_FIELDS = (
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim",
)  # fmt: skip
# Qwen3-Next checkpoints ship a multi-token-prediction head that the causal LM never uses.
IGNORED_PREFIXES = ("mtp.",)


def config_from_hf(values: dict[str, Any]) -> QwenConfig:
    """QwenConfig from a transformers config.json (v4 or v5 layout), or a ConfigError saying why
    the checkpoint is not one this model can run."""
    model_type = values.get("model_type")
    if model_type not in HF_DEFAULTS:
        raise ConfigError(
            f"config.json has model_type={model_type!r}; QwenLM loads {sorted(HF_DEFAULTS)}"
        )
    hf = {**COMMON_DEFAULTS, **HF_DEFAULTS[model_type], **values}
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    unsupported = {
        "hidden_act": hf["hidden_act"] != "silu",
        "rope_type": rope.get("rope_type", rope.get("type", "default")) != "default",
        "use_sliding_window": bool(hf.get("use_sliding_window")),
        "num_experts (mixture of experts; only the dense MLP is implemented)": bool(
            hf.get("num_experts")
        ),
    }
    problems = [name for name, bad in unsupported.items() if bad]
    if problems:
        raise ConfigError(f"config.json asks for what QwenLM does not implement: {problems}")
    values = {name: hf[name] for name in COPIED_FIELDS}
    values["num_key_value_heads"] = hf["num_key_value_heads"] or hf["num_attention_heads"]
    values["rope_theta"] = float(rope.get("rope_theta", hf["rope_theta"]))
    values["partial_rotary_factor"] = rope.get("partial_rotary_factor", hf["partial_rotary_factor"])
    if model_type == "qwen3_next":
        values.update({name: hf[name] for name in LINEAR_FIELDS})
        interval = hf["full_attention_interval"]
        values["layer_types"] = hf.get("layer_types") or [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(hf["num_hidden_layers"])
        ]
    return QwenConfig(model_type=model_type, **values)


def config_to_hf(config: QwenConfig, dtype: torch.dtype) -> dict[str, Any]:
    """config.json content that transformers v4.57+ and v5 both read as this model.

    RoPE settings appear in both layouts: v4's top-level keys and v5's `rope_parameters`.
    """
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    values = {
        "architectures": [ARCHITECTURES[config.model_type]],
        "model_type": config.model_type,
        **{name: getattr(config, name) for name in COPIED_FIELDS},
        "num_key_value_heads": config.num_key_value_heads,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "layer_types": config.layer_types,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if config.is_next:
        rope["partial_rotary_factor"] = config.partial_rotary_factor
        values.update({name: getattr(config, name) for name in LINEAR_FIELDS})
        values.update(
            partial_rotary_factor=config.partial_rotary_factor,
            num_experts=0,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    else:
        values.update(use_sliding_window=False, sliding_window=None)
    values["rope_parameters"] = rope
    return values


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
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise MissingFileError(f"{path} not found: expected a transformers-format model folder")
    return config_from_hf(json.loads(path.read_text()))


def read_hf_weights(
    directory: str | Path, expected: dict[str, torch.Tensor], tied: bool
) -> dict[str, torch.Tensor]:
    """The folder's tensors, checked against `expected` (the model's state dict, shapes only).

    Reads model.safetensors, or the shards listed in model.safetensors.index.json. Raises a
    CheckpointError naming every missing, unexpected or misshapen key.
    """
    directory = Path(directory)
    state: dict[str, torch.Tensor] = {}
    for file in _weight_files(directory):
        state.update(load_file(file))
    state = {key: t for key, t in state.items() if not key.startswith(IGNORED_PREFIXES)}
    if tied:  # saved without lm_head (it is the embedding), though some files repeat it
        state.pop("lm_head.weight", None)
        expected = {key: t for key, t in expected.items() if key != "lm_head.weight"}
    if problems := describe_mismatch(expected, state):
        raise CheckpointError(
            f"The weights in {directory} do not fit the model its config.json describes: "
            f"{problems}."
        )
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def save_hf_directory(model, directory: str | Path, max_shard_bytes: int | None = None) -> None:
    """config.json and model.safetensors, or shards of at most `max_shard_bytes` plus an index."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        key: tensor.detach().contiguous()
        for key, tensor in model.state_dict().items()
        if not (model.config.tie_word_embeddings and key == "lm_head.weight")
    }
    dtype = next(iter(tensors.values())).dtype
    config = config_to_hf(model.config, dtype)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
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


def _weight_files(directory: Path) -> list[Path]:
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
