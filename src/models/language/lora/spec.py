"""The `adapter` config group's values for LoRA, and the peft config they stand for."""

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from src.utils.errors import ConfigError

# Every projection of Qwen3 / Qwen3-Next / Qwen3.5 layers, by the checkpoints' names: full
# attention, Gated DeltaNet, MLP. Names a model lacks (in_proj_* in a dense Qwen3) match nothing.
DEFAULT_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "in_proj_qkvz",
    "in_proj_ba",
    "in_proj_qkv",  # Qwen3.5's Gated DeltaNet: four projections instead of the two above
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "out_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


def import_peft():
    """peft, imported when first used.

    It loads much of transformers (about 1 s), which runs without adapters never need.
    """
    import peft

    return peft


@dataclass(frozen=True)
class AdapterSpec:
    """The `adapter` config group's values, which describe the LoRA adapters to inject.

    LoRA rank `r`, scale `alpha / r`, dropout on the adapters' input, the module names to adapt,
    and optionally `path`, a peft adapter folder to start from (which then sets r, alpha and
    target_modules).
    """

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    path: str | None = None

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "AdapterSpec":
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(values) - known):
            raise ConfigError(f"adapter: unknown keys {unknown}; it takes {sorted(known)}")
        values = dict(values)
        if "target_modules" in values:
            targets = values["target_modules"]
            values["target_modules"] = (targets,) if isinstance(targets, str) else tuple(targets)
        spec = cls(**values)
        if int(spec.r) < 1 or not spec.target_modules or not 0 <= float(spec.dropout) < 1:
            raise ConfigError(
                f"adapter: r must be at least 1 (got {spec.r}), dropout in [0, 1) (got "
                f"{spec.dropout}) and target_modules non-empty (got {list(spec.target_modules)})"
            )
        return spec

    @classmethod
    def default(cls, name: str) -> Any:
        """The value a key takes when the config leaves it out."""
        return cls.__dataclass_fields__[name].default

    def to_dict(self) -> dict[str, Any]:
        """Plain values (a checkpoint's hyperparameters)."""
        values = asdict(self)
        values["target_modules"] = list(self.target_modules)
        return values

    def lora_config(self):
        return import_peft().LoraConfig(
            r=int(self.r),
            lora_alpha=float(self.alpha),
            lora_dropout=float(self.dropout),
            target_modules=list(self.target_modules),
        )
