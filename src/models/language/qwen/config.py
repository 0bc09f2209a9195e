"""The hyperparameters of a Qwen3, Qwen3-MoE, Qwen3-Next or Qwen3.5 decoder, with HF's names."""

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from src.models.language.qwen.transformers_format.state_dict_adapter import ADAPTERS
from src.utils.errors import ConfigError

LAYER_TYPES = ("full_attention", "linear_attention")
# Sizes and scales, checked before anything is derived from them.
POSITIVE_INTEGERS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
    "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
    "linear_chunk_size", "max_position_embeddings",
)  # fmt: skip
POSITIVE_NUMBERS = ("rope_theta", "partial_rotary_factor", "rms_norm_eps", "initializer_range")
# The sizes of a mixture of experts, checked where num_experts > 0.
EXPERT_INTEGERS = ("num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step")
# transformers' Qwen3_5TextRotaryEmbedding default: frequencies per temporal/height/width stream.
DEFAULT_MROPE_SECTION = (11, 11, 10)


@dataclass(frozen=True)
class Family:
    """What sets a family's math apart, so that the model asks for a trait, not a model type.

    - `zero_centred_norms`: RMSNorm gains are `1 + weight` (weight starting at 0).
    - `gated_attention`: attention output times sigmoid(gate), q_proj twice as wide.
    - `linear_attention`: Gated DeltaNet layers exist; by default every layer but each fourth.
    - `fused_linear_projections`: the DeltaNet's inputs come from the head-interleaved
      `in_proj_qkvz` / `in_proj_ba` (Qwen3-Next), else from `in_proj_qkv`, `in_proj_z`,
      `in_proj_b`, `in_proj_a` (Qwen3.5).
    - `multimodal_rope`: RoPE takes temporal/height/width positions, interleaved by
      `mrope_section` (Qwen3.5); on text the three are equal and it is plain RoPE.
    """

    zero_centred_norms: bool = False
    gated_attention: bool = False
    linear_attention: bool = False
    fused_linear_projections: bool = False
    multimodal_rope: bool = False


_QWEN3_5 = Family(
    zero_centred_norms=True, gated_attention=True, linear_attention=True, multimodal_rope=True
)
# One entry per model type of ADAPTERS; the text-only and multimodal folders of one family
# share its math and differ only in their checkpoints' layout (the adapter's business).
FAMILIES: dict[str, Family] = {
    "qwen3": Family(),
    "qwen3_moe": Family(),
    "qwen3_next": Family(
        zero_centred_norms=True,
        gated_attention=True,
        linear_attention=True,
        fused_linear_projections=True,
    ),
    "qwen3_5_text": _QWEN3_5,
    "qwen3_5": _QWEN3_5,
    "qwen3_5_moe_text": _QWEN3_5,
    "qwen3_5_moe": _QWEN3_5,
}


@dataclass
class QwenConfig:
    """Every field that changes the math or the parameter shapes, with the `config.json` names.

    `model_type` picks the family (FAMILIES) and the checkpoint layout (the state-dict adapter).
    "qwen3": RMSNorm with a plain gain, per-head q/k norms, RoPE on the whole head.
    "qwen3_next": zero-centred norms, attention with a sigmoid output gate and RoPE on the first
    `partial_rotary_factor` of each head, and a Gated DeltaNet wherever `layer_types` says
    "linear_attention" (by default every layer but each fourth). "qwen3_5_text" (a text-only
    folder) and "qwen3_5" (the multimodal folder, whose language model this is): Qwen3-Next's
    math with four separate DeltaNet input projections and interleaved multimodal RoPE
    (`mrope_section`). "qwen3_moe", "qwen3_5_moe_text" and "qwen3_5_moe" are Qwen3's and
    Qwen3.5's math with a mixture of experts.

    The MLP is a dense SwiGLU of `intermediate_size` unless `num_experts` > 0: then every layer
    that `is_sparse_layer` names holds a SparseMoeBlock (moe.py) of `num_experts` experts of
    `moe_intermediate_size`, `num_experts_per_tok` of them per token (their weights renormalised
    when `norm_topk_prob`), plus a gated shared expert of `shared_expert_intermediate_size` when
    that is > 0. `router_aux_loss_coef` weighs the load-balancing loss added in training.

    `image_token_id` / `video_token_id` (multimodal folders) are ids that the vision tower would
    fill in: QwenLM trains the text model only and refuses inputs holding them.

    The defaults are Qwen3-0.6B's dimensions; the `linear_*` defaults are Qwen3-Next-80B's.
    `linear_chunk_size` is this implementation's own: the block length of the chunked Gated
    DeltaNet, which changes speed, never results.
    """

    model_type: str = "qwen3"
    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    rope_theta: float = 1_000_000.0
    partial_rotary_factor: float = 1.0
    mrope_section: list[int] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    layer_types: list[str] | None = None
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    linear_chunk_size: int = 64
    max_position_embeddings: int = 40960
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    image_token_id: int | None = None
    video_token_id: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    router_aux_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        if self.model_type not in ADAPTERS:  # the model types are those with a state-dict adapter
            raise ConfigError(
                f"Invalid QwenConfig: model_type={self.model_type!r}; supported: "
                f"{', '.join(ADAPTERS)}"
            )
        if bad := list(self._bad_values()):
            raise ConfigError(
                f"Invalid QwenConfig: {'; '.join(bad)}. Set them on the command line as "
                f"model.config.<name>=<value>."
            )
        if self.layer_types is None:
            self.layer_types = [self._default_layer_type(i) for i in range(self.num_hidden_layers)]
        self.layer_types = list(self.layer_types)
        if self.mrope_section is None and self.multimodal_rope:
            self.mrope_section = list(DEFAULT_MROPE_SECTION)
        if self.mrope_section is not None:
            self.mrope_section = list(self.mrope_section)
        self.mlp_only_layers = list(self.mlp_only_layers)
        problems = list(self._problems(self.layer_types))
        if problems:
            raise ConfigError(f"Invalid QwenConfig: {'; '.join(problems)}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "QwenConfig":
        """From plain values (a YAML node, a checkpoint's hyperparameters); names unknown keys."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"Unknown QwenConfig fields {unknown}; the fields are {sorted(known)}"
            )
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values only, safe in checkpoints loaded with `weights_only=True`."""
        return asdict(self)

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    @property
    def zero_centred_norms(self) -> bool:
        return self.family.zero_centred_norms

    @property
    def gated_attention(self) -> bool:
        return self.family.gated_attention

    @property
    def fused_linear_projections(self) -> bool:
        return self.family.fused_linear_projections

    @property
    def multimodal_rope(self) -> bool:
        return self.family.multimodal_rope

    @property
    def is_next(self) -> bool:
        """Whether the checkpoints are Qwen3-Next's (peft's quirks are by model type)."""
        return self.model_type == "qwen3_next"

    def is_sparse_layer(self, index: int) -> bool:
        """Whether layer `index` holds a mixture of experts, as transformers decides it."""
        return (
            self.num_experts > 0
            and index not in self.mlp_only_layers
            and (index + 1) % self.decoder_sparse_step == 0
        )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def vision_token_ids(self) -> list[int]:
        """The ids a vision tower would fill in, which a text-only model cannot read."""
        return [i for i in (self.image_token_id, self.video_token_id) if i is not None]

    def _default_layer_type(self, index: int) -> str:
        # transformers' `full_attention_interval` of 4: three Gated DeltaNet layers, then attention.
        if self.family.linear_attention and (index + 1) % 4:
            return "linear_attention"
        return "full_attention"

    def _bad_values(self):
        for name in POSITIVE_INTEGERS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                yield f"{name}={value!r} must be a whole number of at least 1"
        for name in POSITIVE_NUMBERS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                yield f"{name}={value!r} must be a number above 0"
        for name in ("num_experts", "shared_expert_intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                yield f"{name}={value!r} must be a whole number, 0 for none"
        for name in EXPERT_INTEGERS if self.num_experts else ():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                yield f"{name}={value!r} must be a whole number of at least 1"

    def _problems(self, layer_types: list[str]):
        if len(layer_types) != self.num_hidden_layers:
            yield (
                f"layer_types has {len(layer_types)} entries for "
                f"num_hidden_layers={self.num_hidden_layers}"
            )
        unknown_types = sorted(set(layer_types) - set(LAYER_TYPES))
        if unknown_types:
            yield f"layer_types {unknown_types} are not among {list(LAYER_TYPES)}"
        if not self.family.linear_attention and "linear_attention" in layer_types:
            hybrid = [name for name, family in FAMILIES.items() if family.linear_attention]
            yield f"linear_attention layers need model_type={' or '.join(map(repr, hybrid))}"
        if self.num_attention_heads % self.num_key_value_heads:
            yield (
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.rotary_dim % 2 or self.rotary_dim == 0:
            yield (
                f"head_dim * partial_rotary_factor = {self.head_dim * self.partial_rotary_factor} "
                "must be an even number of rotated dimensions"
            )
        if self.mrope_section is not None and not self.multimodal_rope:
            yield f"mrope_section is multimodal RoPE's, which model_type={self.model_type!r} lacks"
        elif self.mrope_section is not None and (
            len(self.mrope_section) != 3 or any(s < 0 for s in self.mrope_section)
        ):
            yield (
                f"mrope_section={self.mrope_section} must give 3 frequency counts "
                "(temporal, height, width)"
            )
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            yield (
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds "
                f"num_experts={self.num_experts}"
            )
        outside = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if outside:
            yield f"mlp_only_layers {outside} are not layers of 0..{self.num_hidden_layers - 1}"
        if self.router_aux_loss_coef < 0:
            yield f"router_aux_loss_coef={self.router_aux_loss_coef} must be 0 or more"
        linear = "linear_attention" in layer_types
        if linear and self.linear_num_value_heads % self.linear_num_key_heads:
            yield (
                f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}"
            )
