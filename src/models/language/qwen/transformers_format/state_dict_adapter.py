"""The mapping between QwenLM and transformers' checkpoints, one adapter per `model_type`.

An adapter keeps one contract (`QwenStateDictAdapter`'s methods): `config_from_hf` and
`config_to_hf` map config.json to QwenConfig's fields and back, and an adapter made for one
QwenConfig maps state dicts with `from_hf` and `to_hf`, and single names with `hf_key`.
Checkpoint tensors that QwenLM does not use (`unused_prefixes`: a vision tower, MTP layers)
stay out of its state dict; `folders` writes them back from the source folder on saving.
`ADAPTERS` is the one place that says which model types exist: a variant is an adapter added
there, with its family in config.FAMILIES (and, where its math differs, a block in the model).
"""

import copy
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from src.models.language.qwen.transformers_format.expert_layout import (
    stack_experts,
    unstack_experts,
)
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
# A mixture of experts' sizes; a config.json without `num_experts` describes a dense model.
EXPERT_FIELDS = (
    "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
    "router_aux_loss_coef",
)  # fmt: skip
TIED_HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"
DECODER = "model."  # QwenLM's prefix of everything but lm_head


class QwenStateDictAdapter:
    """What every variant's adapter shares, the base each model type's adapter extends.

    Shared: the config.json keys and parameter names that are QwenLM's own, and a tied lm_head
    left out of checkpoints (the embedding stands for it).

    A variant sets `model_type`, `architecture` (transformers' class) and `defaults`
    (transformers' config class defaults, on top of COMMON_DEFAULTS), and extends the four
    methods where its checkpoints differ.
    """

    model_type: ClassVar[str]
    architecture: ClassVar[str]
    defaults: ClassVar[dict[str, Any]]
    # Weights of released checkpoints that the causal LM never uses (kept on saving).
    unused_prefixes: ClassVar[tuple[str, ...]] = ()
    # Where the checkpoint keeps the decoder that QwenLM calls `model.`.
    decoder_prefix: ClassVar[str] = DECODER
    # Whether a model saves without the folder it came from (not one with a vision tower).
    saves_alone: ClassVar[bool] = True
    # The mixture-of-experts fields that this model type's config.json carries.
    expert_fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: "QwenConfig"):
        self.config = config

    @classmethod
    def config_from_hf(cls, values: dict[str, Any]) -> dict[str, Any]:
        """QwenConfig's fields from a config.json (v4 or v5 layout).

        Raises a ConfigError naming what the config.json asks for that QwenLM does not implement.
        """
        hf = {**COMMON_DEFAULTS, **cls.defaults, **values}
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        unsupported = {
            "hidden_act": hf["hidden_act"] != "silu",
            "rope_type": rope.get("rope_type", rope.get("type", "default")) != "default",
            "use_sliding_window": bool(hf.get("use_sliding_window")),
        }
        if problems := [name for name, bad in unsupported.items() if bad]:
            raise ConfigError(f"config.json asks for what QwenLM does not implement: {problems}")
        fields = {name: hf[name] for name in COPIED_FIELDS}
        # Qwen3-MoE's config class has no head_dim: its attention divides the hidden size.
        fields["head_dim"] = hf["head_dim"] or hf["hidden_size"] // hf["num_attention_heads"]
        if hf.get("num_experts"):  # a dense model keeps QwenConfig's (unused) expert defaults
            fields.update({name: hf[name] for name in EXPERT_FIELDS if name in hf})
        fields["model_type"] = cls.model_type
        fields["num_key_value_heads"] = hf["num_key_value_heads"] or hf["num_attention_heads"]
        fields["rope_theta"] = float(rope.get("rope_theta", hf["rope_theta"]))
        fields["partial_rotary_factor"] = rope.get(
            "partial_rotary_factor", hf["partial_rotary_factor"]
        )
        return fields

    @classmethod
    def config_to_hf(
        cls, config: "QwenConfig", original: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """config.json content that transformers v4.57+ and v5 both read as this model.

        RoPE settings appear in both layouts: v4's top-level keys and v5's `rope_parameters`.
        `original` is the config.json of the folder the model was loaded from, if any: what
        QwenConfig does not describe (a vision tower's config) comes from there.
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
            **{name: getattr(config, name) for name in cls.expert_fields},
        }

    def hf_key(self, key: str) -> str:
        """The checkpoint's name for QwenLM's parameter `key`."""
        if key.startswith(DECODER):
            return self.decoder_prefix + key.removeprefix(DECODER)
        return key

    def key_from_hf(self, hf_key: str) -> str:
        """QwenLM's name for the checkpoint's tensor `hf_key` (one it uses)."""
        if hf_key.startswith(self.decoder_prefix):
            return DECODER + hf_key.removeprefix(self.decoder_prefix)
        return hf_key

    def is_unused(self, hf_key: str) -> bool:
        """Whether the checkpoint's tensor `hf_key` is one QwenLM never reads."""
        return hf_key.startswith(self.unused_prefixes)

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors for QwenLM's state dict."""
        tied = self.config.tie_word_embeddings
        # Experts as released checkpoints keep them: one tensor per expert and projection.
        return {
            self.hf_key(key): t
            for key, t in unstack_experts(state_dict).items()
            if not (tied and key == TIED_HEAD)
        }

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """QwenLM's state dict for a checkpoint's tensors, less those it never uses."""
        used = {key: t for key, t in hf_state_dict.items() if not self.is_unused(key)}
        state = {self.key_from_hf(key): t for key, t in stack_experts(used).items()}
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
    def config_to_hf(
        cls, config: "QwenConfig", original: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return {**super().config_to_hf(config), "use_sliding_window": False, "sliding_window": None}


class Qwen3MoeStateDictAdapter(Qwen3StateDictAdapter):
    """transformers' Qwen3MoeForCausalLM: Qwen3 with a mixture of experts, no shared expert."""

    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    defaults: ClassVar[dict[str, Any]] = {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": None, "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
        "max_position_embeddings": 32768, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768, "shared_expert_intermediate_size": 0,
        "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
    }  # fmt: skip
    expert_fields = tuple(
        name for name in EXPERT_FIELDS if name != "shared_expert_intermediate_size"
    )

    @classmethod
    def config_from_hf(cls, values: dict[str, Any]) -> dict[str, Any]:
        # transformers 5 writes `num_local_experts` (its attribute map), the hub `num_experts`.
        if "num_local_experts" in values:
            values = {**values, "num_experts": values["num_local_experts"]}
        return super().config_from_hf(values)


class Qwen3NextStateDictAdapter(QwenStateDictAdapter):
    """transformers' Qwen3NextForCausalLM: Qwen3's names plus the DeltaNet's and the experts'.

    The Gated DeltaNet layers have names of their own, and released checkpoints also hold a
    multi-token-prediction head (`mtp.`). Every released Qwen3-Next is a mixture of experts;
    `num_experts: 0` in config.json makes every MLP dense.
    """

    model_type = "qwen3_next"
    architecture = "Qwen3NextForCausalLM"
    defaults: ClassVar[dict[str, Any]] = {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
        "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 256, "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
        "max_position_embeddings": 32768, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "num_experts": 512,
        "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "router_aux_loss_coef": 0.001,
    }  # fmt: skip
    unused_prefixes = ("mtp.",)
    expert_fields = EXPERT_FIELDS

    @classmethod
    def config_from_hf(cls, values: dict[str, Any]) -> dict[str, Any]:
        return {**super().config_from_hf(values), **hybrid_fields_from_hf(cls.defaults, values)}

    @classmethod
    def config_to_hf(
        cls, config: "QwenConfig", original: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return hybrid_config_to_hf(super().config_to_hf(config), config)


class Qwen3_5TextStateDictAdapter(QwenStateDictAdapter):
    """transformers' Qwen3_5ForCausalLM: Qwen3-Next's names with the DeltaNet's four projections.

    `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` are QwenLM's own names too, so only
    the config differs: interleaved multimodal RoPE (`mrope_section` in `rope_parameters`).
    """

    model_type = "qwen3_5_text"
    architecture = "Qwen3_5ForCausalLM"
    defaults: ClassVar[dict[str, Any]] = {
        "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
        "head_dim": 256, "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
        "max_position_embeddings": 32768, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    }  # fmt: skip
    unused_prefixes: ClassVar[tuple[str, ...]] = ("mtp.",)

    @classmethod
    def config_from_hf(cls, values: dict[str, Any]) -> dict[str, Any]:
        fields = {**super().config_from_hf(values), **hybrid_fields_from_hf(cls.defaults, values)}
        rope = values.get("rope_parameters") or values.get("rope_scaling") or {}
        fields["mrope_section"] = list(rope.get("mrope_section", [11, 11, 10]))
        return fields

    @classmethod
    def config_to_hf(
        cls, config: "QwenConfig", original: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        values = hybrid_config_to_hf(super().config_to_hf(config), config)
        # transformers' Qwen3.5 RoPE always interleaves; the flag is what the hub's files say.
        rope = {
            **values["rope_parameters"],
            "mrope_section": config.mrope_section,
            "mrope_interleaved": True,
        }
        return {**values, "rope_parameters": rope}


class Qwen3_5StateDictAdapter(Qwen3_5TextStateDictAdapter):
    """transformers' Qwen3_5ForConditionalGeneration, the folder the hub ships, text part only.

    The config nests the language model's under `text_config` beside `vision_config` and the
    vision token ids; the weights keep it under `model.language_model.`, `lm_head.weight` at the
    top. The vision tower (`model.visual.`) and the MTP layers (`mtp.`) are not QwenLM's: they
    are written back, as they were, from the folder the model was loaded from.
    """

    model_type = "qwen3_5"
    architecture = "Qwen3_5ForConditionalGeneration"
    text_model_type: ClassVar[str] = Qwen3_5TextStateDictAdapter.model_type
    unused_prefixes = ("model.visual.", "mtp.")
    decoder_prefix = "model.language_model."
    saves_alone = False
    # transformers' Qwen3_5Config defaults.
    token_ids: ClassVar[dict[str, int]] = {"image_token_id": 248056, "video_token_id": 248057}

    @classmethod
    def config_from_hf(cls, values: dict[str, Any]) -> dict[str, Any]:
        fields = super().config_from_hf(values.get("text_config") or {})
        fields["model_type"] = cls.model_type
        # transformers ties the head by the outer config's flag (Qwen3_5Config's default: no).
        fields["tie_word_embeddings"] = values.get("tie_word_embeddings", False)
        fields.update({name: values.get(name, default) for name, default in cls.token_ids.items()})
        return fields

    @classmethod
    def config_to_hf(
        cls, config: "QwenConfig", original: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        if original is None:
            raise ConfigError(
                "A model_type=qwen3_5 model is the language model of a multimodal folder and is "
                "saved with that folder's vision tower, but it was not loaded from one. Load it "
                "with QwenLM.from_pretrained(<folder>) (model.pretrained=<folder>), or set "
                "model_type=qwen3_5_text to save the text model alone."
            )
        text = super().config_to_hf(config)
        text["model_type"] = cls.text_model_type
        del text["architectures"]
        values = copy.deepcopy(original)
        values["text_config"] = {**values.get("text_config", {}), **text}
        values.update({name: getattr(config, name) for name in cls.token_ids})
        values["tie_word_embeddings"] = config.tie_word_embeddings
        values["architectures"] = [cls.architecture]
        return values


class Qwen3_5MoeTextStateDictAdapter(Qwen3_5TextStateDictAdapter):
    """transformers' Qwen3_5MoeForCausalLM: Qwen3.5 with a mixture of experts in every layer.

    Its router always renormalises the top-k weights, and it has a gated shared expert.
    Its config class has no dense `intermediate_size`; a placeholder fills QwenConfig's.
    """

    model_type = "qwen3_5_moe_text"
    architecture = "Qwen3_5MoeForCausalLM"
    defaults: ClassVar[dict[str, Any]] = {
        **Qwen3_5TextStateDictAdapter.defaults, "hidden_size": 2048, "num_hidden_layers": 40,
        "num_key_value_heads": 2, "intermediate_size": 512, "num_experts": 256,
        "num_experts_per_tok": 8, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "router_aux_loss_coef": 0.001,
    }  # fmt: skip
    expert_fields = (
        "num_experts", "num_experts_per_tok", "moe_intermediate_size",
        "shared_expert_intermediate_size", "router_aux_loss_coef",
    )  # fmt: skip


class Qwen3_5MoeStateDictAdapter(Qwen3_5StateDictAdapter, Qwen3_5MoeTextStateDictAdapter):
    """transformers' Qwen3_5MoeForConditionalGeneration (Qwen3.5-MoE, Qwen3.6), text part only.

    Qwen3.5's multimodal folder around a Qwen3.5-MoE language model.
    """

    model_type = "qwen3_5_moe"
    architecture = "Qwen3_5MoeForConditionalGeneration"
    text_model_type = Qwen3_5MoeTextStateDictAdapter.model_type


def hybrid_fields_from_hf(defaults: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """The Gated DeltaNet sizes and `layer_types` of a hybrid model's config.json."""
    hf = {**defaults, **values}
    fields = {name: hf[name] for name in LINEAR_FIELDS}
    interval = hf["full_attention_interval"]
    fields["layer_types"] = hf.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(hf["num_hidden_layers"])
    ]
    return fields


def hybrid_config_to_hf(values: dict[str, Any], config: "QwenConfig") -> dict[str, Any]:
    """`values` plus a hybrid model's Gated DeltaNet sizes and partial rotary factor."""
    rope = {**values["rope_parameters"], "partial_rotary_factor": config.partial_rotary_factor}
    return {
        **values,
        **{name: getattr(config, name) for name in LINEAR_FIELDS},
        "partial_rotary_factor": config.partial_rotary_factor,
        "rope_parameters": rope,
    }


ADAPTERS: dict[str, type[QwenStateDictAdapter]] = {
    adapter.model_type: adapter
    for adapter in (
        Qwen3StateDictAdapter,
        Qwen3NextStateDictAdapter,
        Qwen3MoeStateDictAdapter,
        Qwen3_5TextStateDictAdapter,
        Qwen3_5StateDictAdapter,
        Qwen3_5MoeTextStateDictAdapter,
        Qwen3_5MoeStateDictAdapter,
    )
}


def adapter_for(config: "QwenConfig") -> QwenStateDictAdapter:
    """The state-dict adapter of `config`'s model type."""
    return ADAPTERS[config.model_type](config)
