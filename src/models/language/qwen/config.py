"""The hyperparameters of a Qwen3 (dense) or Qwen3-Next (hybrid) decoder, with HF's names."""

from dataclasses import asdict, dataclass, fields
from typing import Any

from src.models.language.qwen.state_dict_adapter import ADAPTERS
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


@dataclass
class QwenConfig:
    """Every field that changes the math or the parameter shapes, with the `config.json` names.

    `model_type` picks the family. "qwen3": RMSNorm with a plain gain, per-head q/k norms, RoPE
    on the whole head. "qwen3_next": zero-centred norms, attention with a sigmoid output gate and
    RoPE on the first `partial_rotary_factor` of each head, and a Gated DeltaNet wherever
    `layer_types` says "linear_attention" (by default every layer but each fourth). Both use a
    dense SwiGLU MLP: Qwen3-Next's mixture of experts is not implemented.

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

    def __post_init__(self) -> None:
        if bad := list(self._bad_values()):
            raise ConfigError(
                f"Invalid QwenConfig: {'; '.join(bad)}. Set them on the command line as "
                f"model.config.<name>=<value>."
            )
        if self.layer_types is None:
            self.layer_types = [self._default_layer_type(i) for i in range(self.num_hidden_layers)]
        self.layer_types = list(self.layer_types)
        problems = list(self._problems())
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
    def is_next(self) -> bool:
        return self.model_type == "qwen3_next"

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def _default_layer_type(self, index: int) -> str:
        # Qwen3-Next's `full_attention_interval` of 4: three Gated DeltaNet layers, then attention.
        if self.is_next and (index + 1) % 4:
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

    def _problems(self):
        if self.model_type not in ADAPTERS:  # the model types are those with a state-dict adapter
            yield f"model_type={self.model_type!r}; supported: {', '.join(ADAPTERS)}"
        if len(self.layer_types) != self.num_hidden_layers:
            yield (
                f"layer_types has {len(self.layer_types)} entries for "
                f"num_hidden_layers={self.num_hidden_layers}"
            )
        unknown_types = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown_types:
            yield f"layer_types {unknown_types} are not among {list(LAYER_TYPES)}"
        if not self.is_next and "linear_attention" in self.layer_types:
            yield "linear_attention layers need model_type='qwen3_next'"
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
        linear = "linear_attention" in self.layer_types
        if linear and self.linear_num_value_heads % self.linear_num_key_heads:
            yield (
                f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}"
            )
