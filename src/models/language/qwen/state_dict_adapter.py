"""The mapping between QwenLM and transformers' checkpoints, one adapter per `model_type`.

An adapter keeps one contract (`QwenStateDictAdapter`'s methods): `config_from_hf` and
`config_to_hf` map config.json to QwenConfig's fields and back, and an adapter made for one
QwenConfig maps state dicts with `from_hf` and `to_hf`. `ADAPTERS` is the one place that says
which model types exist: a variant is an adapter added there (and, where its math differs, a
block in the model).
"""

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from src.utils.errors import ConfigError

if TYPE_CHECKING:  # QwenConfig takes its model types from ADAPTERS below
    from src.models.language.qwen.config import QwenConfig

# transformers' defaults of every Qwen config class, for keys a config.json leaves out.
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
TIED_HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


class QwenStateDictAdapter:
    """What every variant's adapter shares: config.json keys and parameter names that are
    QwenLM's own, a tied lm_head left out of checkpoints (the embedding stands for it).

    A variant sets `model_type`, `architecture` (transformers' class) and `defaults`
    (transformers' config class defaults, on top of COMMON_DEFAULTS), and extends the four
    methods where its checkpoints differ.
    """

    model_type: ClassVar[str]
    architecture: ClassVar[str]
    defaults: ClassVar[dict[str, Any]]
    # Weights of released checkpoints that the causal LM never uses.
    unused_prefixes: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: "QwenConfig"):
        self.config = config

    @classmethod
    def config_from_hf(cls, values: dict[str, Any]) -> dict[str, Any]:
        """QwenConfig's fields from a config.json (v4 or v5 layout), or a ConfigError naming what
        it asks for that QwenLM does not implement."""
        hf = {**COMMON_DEFAULTS, **cls.defaults, **values}
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        unsupported = {
            "hidden_act": hf["hidden_act"] != "silu",
            "rope_type": rope.get("rope_type", rope.get("type", "default")) != "default",
            "use_sliding_window": bool(hf.get("use_sliding_window")),
            "num_experts (mixture of experts; only the dense MLP is implemented)": bool(
                hf.get("num_experts")
            ),
        }
        if problems := [name for name, bad in unsupported.items() if bad]:
            raise ConfigError(f"config.json asks for what QwenLM does not implement: {problems}")
        fields = {name: hf[name] for name in COPIED_FIELDS}
        fields["model_type"] = cls.model_type
        fields["num_key_value_heads"] = hf["num_key_value_heads"] or hf["num_attention_heads"]
        fields["rope_theta"] = float(rope.get("rope_theta", hf["rope_theta"]))
        fields["partial_rotary_factor"] = rope.get(
            "partial_rotary_factor", hf["partial_rotary_factor"]
        )
        return fields

    @classmethod
    def config_to_hf(cls, config: "QwenConfig") -> dict[str, Any]:
        """config.json content that transformers v4.57+ and v5 both read as this model.

        RoPE settings appear in both layouts: v4's top-level keys and v5's `rope_parameters`.
        """
        return {
            "architectures": [cls.architecture],
            "model_type": cls.model_type,
            **{name: getattr(config, name) for name in COPIED_FIELDS},
            "num_key_value_heads": config.num_key_value_heads,
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "layer_types": config.layer_types,
            "rope_theta": config.rope_theta,
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        }

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors for QwenLM's state dict."""
        if self.config.tie_word_embeddings:
            return {key: t for key, t in state_dict.items() if key != TIED_HEAD}
        return dict(state_dict)

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """QwenLM's state dict for a checkpoint's tensors, less those it never uses."""
        state = {
            key: t for key, t in hf_state_dict.items() if not key.startswith(self.unused_prefixes)
        }
        # Tied: the embedding is the head, whether or not the file repeats it as lm_head.
        if self.config.tie_word_embeddings and EMBEDDING in state:
            state[TIED_HEAD] = state[EMBEDDING]
        return state


class Qwen3StateDictAdapter(QwenStateDictAdapter):
    """transformers' Qwen3ForCausalLM, whose parameter names are QwenLM's."""

    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    defaults: ClassVar[dict[str, Any]] = {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
        "head_dim": 128, "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
        "max_position_embeddings": 32768,
    }  # fmt: skip

    @classmethod
    def config_to_hf(cls, config: "QwenConfig") -> dict[str, Any]:
        return {**super().config_to_hf(config), "use_sliding_window": False, "sliding_window": None}


class Qwen3NextStateDictAdapter(QwenStateDictAdapter):
    """transformers' Qwen3NextForCausalLM with a dense MLP: Qwen3's names plus the Gated DeltaNet
    layers' own, and a multi-token-prediction head (`mtp.`) in released checkpoints."""

    model_type = "qwen3_next"
    architecture = "Qwen3NextForCausalLM"
    defaults: ClassVar[dict[str, Any]] = {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
        "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 256, "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
        "max_position_embeddings": 32768, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "num_experts": 512, "full_attention_interval": 4,
    }  # fmt: skip
    unused_prefixes = ("mtp.",)

    @classmethod
    def config_from_hf(cls, values: dict[str, Any]) -> dict[str, Any]:
        fields = super().config_from_hf(values)
        hf = {**cls.defaults, **values}
        fields.update({name: hf[name] for name in LINEAR_FIELDS})
        interval = hf["full_attention_interval"]
        fields["layer_types"] = hf.get("layer_types") or [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(hf["num_hidden_layers"])
        ]
        return fields

    @classmethod
    def config_to_hf(cls, config: "QwenConfig") -> dict[str, Any]:
        values = super().config_to_hf(config)
        rope = {**values["rope_parameters"], "partial_rotary_factor": config.partial_rotary_factor}
        return {
            **values,
            **{name: getattr(config, name) for name in LINEAR_FIELDS},
            "partial_rotary_factor": config.partial_rotary_factor,
            "rope_parameters": rope,
            "num_experts": 0,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }


ADAPTERS: dict[str, type[QwenStateDictAdapter]] = {
    adapter.model_type: adapter for adapter in (Qwen3StateDictAdapter, Qwen3NextStateDictAdapter)
}


def adapter_for(config: "QwenConfig") -> QwenStateDictAdapter:
    """The state-dict adapter of `config`'s model type."""
    return ADAPTERS[config.model_type](config)
