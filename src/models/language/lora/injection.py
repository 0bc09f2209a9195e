"""LoRA layers in a QwenLM: injecting, reading and merging them.

They are injected on a frozen base, their weights read by the network's names, and folded into
a plain QwenLM.

Peft is given `net.model` (the embedding, layers and norm), never the QwenLM itself: peft reads
`.config.model_type` and, for "qwen3_next", rewrites MLP targets for a mixture-of-experts model
that this dense-MLP Qwen3-Next is not.
"""

from typing import Protocol, cast

import torch

from src.models.language.lora.spec import DEFAULT_TARGETS, AdapterSpec, import_peft
from src.models.language.qwen import QwenLM
from src.utils.errors import CheckpointError, ConfigError
from src.utils.weights import describe_mismatch

ADAPTER_NAME = "default"  # peft's name for the one adapter of a model


class LoraModule(Protocol):
    """What merging asks of each of peft's LoRA layers (Linear, Embedding, ...)."""

    def get_delta_weight(self, adapter: str) -> torch.Tensor: ...


def inject(net: QwenLM, spec: AdapterSpec) -> None:
    """Freeze the whole of `net`, in its own dtype, and inject LoRA layers into it.

    They go into the projections that `spec.target_modules` names, by the checkpoints' own
    module names: only the adapters then require gradients, so only they reach the optimizer.
    """
    net.requires_grad_(False)
    try:
        import_peft().inject_adapter_in_model(
            spec.lora_config(), net.model, adapter_name=ADAPTER_NAME
        )
    except ValueError as error:  # peft's "Target modules ... not found in the base model"
        raise ConfigError(
            f"adapter.target_modules={list(spec.target_modules)} names no linear module of "
            f"this model (its projections: {', '.join(DEFAULT_TARGETS)}): {error}"
        ) from None


def is_adapter_key(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def adapter_state(net: QwenLM) -> dict[str, torch.Tensor]:
    """The adapters' weights, by the network's own names."""
    return {key: value for key, value in net.state_dict().items() if is_adapter_key(key)}


def load_adapter_state(net: QwenLM, state: dict[str, torch.Tensor], where: str) -> None:
    """Load adapter weights into `net`'s adapters, refusing any that do not fit them."""
    if problems := describe_mismatch(adapter_state(net), state):
        raise CheckpointError(f"The adapters in {where} do not fit this model: {problems}.")
    net.load_state_dict(state, strict=False)


def lora_modules(net: QwenLM) -> dict[str, torch.nn.Module]:
    """The LoRA layers (peft's) in `net`, by name."""
    layer = import_peft().tuners.lora.LoraLayer
    return {name: module for name, module in net.named_modules() if isinstance(module, layer)}


@torch.no_grad()
def merged_network(net: QwenLM) -> QwenLM:
    """A plain QwenLM whose adapted weights are W + (alpha / r) B @ A.

    `net` is unchanged and the unadapted tensors are shared with it, not copied.
    """
    deltas = {
        name: cast(LoraModule, module).get_delta_weight(ADAPTER_NAME)
        for name, module in lora_modules(net).items()
    }
    state = {}
    for key, value in net.state_dict().items():
        if is_adapter_key(key):
            continue
        key = key.replace(".base_layer.", ".")
        owner, _, leaf = key.rpartition(".")
        if owner in deltas and leaf == "weight":
            value = value + deltas[owner].to(value.dtype)
        state[key] = value
    with torch.device("meta"):
        merged = QwenLM(net.config)
    merged.load_state_dict(state, strict=True, assign=True)
    merged.tie_weights()
    merged.source = net.source  # what it does not hold is saved from there, as net's is
    return merged
