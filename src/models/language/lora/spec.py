"""The `adapter` config group's values for LoRA, and the peft config they stand for."""

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from typing import Any

from src.utils.errors import ConfigError

# Every projection of Qwen3 / Qwen3-Next / Qwen3.5 layers, by the checkpoints' names: full
# attention, Gated DeltaNet, MLP. Names a model lacks (in_proj_* in a dense Qwen3) match nothing.
# A name matches a module whose name ends with `.<name>`, so in a mixture of experts the MLP names
# match the shared expert's nn.Linear layers (`mlp.shared_expert.gate_proj`) and nothing else:
# not the router (`mlp.gate`, a raw weight), not `mlp.shared_expert_gate`, not the experts (two
# stacked parameters, `target_experts`).
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
# The routed experts' stacked weights, [E, out, in] each, adapted as parameters (peft's
# `target_parameters`): one B @ A per expert. A name matches a parameter whose name ends with it.
EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")
# Names that match no nn.Linear of a mixture of experts, refused with what to ask for instead.
NOT_LINEAR = {
    "gate": "mlp.gate is the router, which LoRA leaves alone",
    "experts": "set adapter.target_experts=true to adapt the experts",
    "gate_up_proj": "set adapter.target_experts=true to adapt the experts",
}


@contextmanager
def quiet_torchao_import() -> Iterator[None]:
    """Silence what importing torchao logs through torch's pytree module.

    torchao 0.18 registers its enums in a way torch 2.14 deprecates, and torch says so in a
    warning per enum that no user can act on. peft imports torchao when it is installed (the
    `qlora` extra), through transformers' quantizers.
    """
    pytree_log = logging.getLogger("torch.utils._pytree")
    level = pytree_log.level
    pytree_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        pytree_log.setLevel(level)


def import_peft():
    """peft, imported when first used.

    It loads much of transformers (about 1 s), which runs without adapters never need.
    """
    with quiet_torchao_import():
        import peft

    return peft


@dataclass(frozen=True)
class AdapterSpec:
    """The `adapter` config group's values, which describe the LoRA adapters to inject.

    LoRA rank `r`, scale `alpha / r`, dropout on the adapters' input, the module names to adapt,
    whether to adapt a mixture of experts' routed experts too (`target_experts`: their stacked
    weights, without dropout, which peft cannot apply to a parameter's input), and optionally
    `path`, a peft adapter folder to start from (which then sets r, alpha and the targets).
    """

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    target_experts: bool = False
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
        if not isinstance(spec.target_experts, bool):
            raise ConfigError(
                f"adapter.target_experts must be true or false, got {spec.target_experts!r}"
            )
        if wrong := [name for name in spec.target_modules if name in NOT_LINEAR]:
            reasons = "; ".join(f"{name}: {NOT_LINEAR[name]}" for name in wrong)
            raise ConfigError(f"adapter.target_modules={list(spec.target_modules)}: {reasons}")
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
        """The peft config for the adapted nn.Linear layers."""
        return import_peft().LoraConfig(
            r=int(self.r),
            lora_alpha=float(self.alpha),
            lora_dropout=float(self.dropout),
            target_modules=list(self.target_modules),
        )

    def expert_lora_config(self):
        """The peft config for the experts' stacked weights; None unless `target_experts`.

        peft takes no dropout on a parameter (0.17 to at least 0.21), so it is 0 there.
        """
        if not self.target_experts:
            return None
        return import_peft().LoraConfig(
            r=int(self.r),
            lora_alpha=float(self.alpha),
            lora_dropout=0.0,
            target_modules=None,
            target_parameters=list(EXPERT_PARAMETERS),
        )
