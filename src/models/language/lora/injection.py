"""LoRA layers in a QwenLM: injecting, reading and merging them.

They are injected on a frozen base, their weights read by the network's names, and folded into
a plain QwenLM.

Peft is given `net.model` (the embedding, layers and norm), never the QwenLM itself: peft reads
`.config.model_type` and, for "qwen3_moe" and "qwen3_next", rewrites the MLP names of the targets
into the routed experts' parameters, which would adapt the experts instead of a dense MLP or a
shared expert.

A mixture of experts' routed experts are adapted as parameters (peft's `target_parameters`,
`lora.ParamWrapper`): the `experts` module is wrapped once per stacked weight, down_proj's wrapper
outermost, so that its weights are named `mlp.experts.base_layer.base_layer.gate_up_proj` and its
adapters `mlp.experts.base_layer.lora_A...` (gate_up_proj's) and `mlp.experts.lora_A...`
(down_proj's), as on transformers' model.
"""

import re
import warnings
from collections.abc import Mapping
from typing import Protocol, cast

import torch

from src.models.language.lora.spec import DEFAULT_TARGETS, AdapterSpec, import_peft
from src.models.language.qwen import QwenLM
from src.utils.errors import CheckpointError, ConfigError
from src.utils.weights import describe_mismatch

ADAPTER_NAME = "default"  # peft's name for the one adapter of a model


class LoraModule(Protocol):
    """What merging asks of each of peft's LoRA layers (Linear, ParamWrapper, ...)."""

    def get_delta_weight(self, adapter: str) -> torch.Tensor: ...


def inject(net: QwenLM, spec: AdapterSpec) -> None:
    """Freeze the whole of `net`, in its own dtype, and inject LoRA layers into it.

    They go into the projections that `spec.target_modules` names, by the checkpoints' own
    module names: only the adapters then require gradients, so only they reach the optimizer.
    With `spec.target_experts` the routed experts' stacked weights are adapted too, in a second
    injection of the same adapter: peft takes no dropout on a parameter, which the first keeps.
    """
    net.requires_grad_(False)
    peft = import_peft()
    try:
        peft.inject_adapter_in_model(spec.lora_config(), net.model, adapter_name=ADAPTER_NAME)
    except ValueError as error:  # peft's "Target modules ... not found in the base model"
        raise ConfigError(
            f"adapter.target_modules={list(spec.target_modules)} names no linear module of "
            f"this model (its projections: {', '.join(DEFAULT_TARGETS)}): {error}"
        ) from None
    experts = spec.expert_lora_config()
    if experts is None:
        return
    if not net.sparse_blocks():
        raise ConfigError(
            f"adapter.target_experts=true adapts a mixture of experts' experts, and this "
            f"{net.config.model_type} model has none (num_experts={net.config.num_experts})"
        )
    with warnings.catch_warnings():  # the second injection of one adapter is meant
        warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
        peft.inject_adapter_in_model(experts, net.model, adapter_name=ADAPTER_NAME)


def is_adapter_key(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def plain_key(key: str) -> str:
    """The name a base weight has without adapters: peft's `.base_layer` (nested too) dropped.

    `mlp.experts.base_layer.base_layer.down_proj` -> `mlp.experts.down_proj`.
    """
    return re.sub(r"\.base_layer(?=\.)", "", key)


def adapter_state(net: QwenLM) -> dict[str, torch.Tensor]:
    """The adapters' weights, by the network's own names."""
    return {key: value for key, value in net.state_dict().items() if is_adapter_key(key)}


def load_adapter_state(net: QwenLM, state: dict[str, torch.Tensor], where: str) -> None:
    """Load adapter weights into `net`'s adapters, refusing any that do not fit them."""
    if problems := describe_mismatch(adapter_state(net), state):
        raise CheckpointError(f"The adapters in {where} do not fit this model: {problems}.")
    net.load_state_dict(state, strict=False)


def lora_modules(net: QwenLM) -> dict[str, torch.nn.Module]:
    """The LoRA layers (peft's) in `net`, by name, parameter wrappers (the experts') included."""
    layer = import_peft().tuners.lora.LoraLayer
    return {name: module for name, module in net.named_modules() if isinstance(module, layer)}


def is_parameter_lora(module: torch.nn.Module) -> bool:
    """Whether a LoRA layer adapts one parameter (peft's `target_parameters`), not a module."""
    return isinstance(module, import_peft().tuners.lora.ParamWrapper)


def adapted_weights(net: QwenLM) -> dict[str, torch.nn.Module]:
    """Each adapted base weight's plain name (`plain_key`), and the LoRA layer adapting it."""
    adapted = {}
    for name, module in lora_modules(net).items():
        leaf = cast(str, module.parameter_name) if is_parameter_lora(module) else "weight"
        adapted[plain_key(f"{name}.{leaf}")] = module
    return adapted


@torch.no_grad()
def merged_network(net: QwenLM, weights: Mapping[str, torch.Tensor] | None = None) -> QwenLM:
    """A plain QwenLM whose adapted weights are W + (alpha / r) B @ A.

    For the experts' stacked weights [E, out, in] that is one B_e @ A_e per expert. `weights`
    is `net`'s state dict as plain tensors (a 4-bit base's dequantised), `net.state_dict()` by
    default. `net` is unchanged and the unadapted tensors are shared with it, not copied.
    """
    deltas = {
        key: cast(LoraModule, module).get_delta_weight(ADAPTER_NAME)
        for key, module in adapted_weights(net).items()
    }
    state = {}
    for key, value in (net.state_dict() if weights is None else weights).items():
        if is_adapter_key(key):
            continue
        key = plain_key(key)
        if key in deltas:
            value = value + deltas.pop(key).to(value.dtype)
        state[key] = value
    assert not deltas, f"adapted weights missing from the state dict: {sorted(deltas)}"
    with torch.device("meta"):
        merged = QwenLM(net.config)
    merged.load_state_dict(state, strict=True, assign=True)
    merged.tie_weights()
    merged.source = net.source  # what it does not hold is saved from there, as net's is
    return merged
