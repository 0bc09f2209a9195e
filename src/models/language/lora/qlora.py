"""QLoRA (`adapter=qlora`): LoRA adapters on a frozen base whose linear weights are 4-bit NF4.

It is LoRA (adapter.py) plus one step: once the pretrained base is in the network, its linear
projections are quantised (quantization.py) and the rest of it cast to the compute dtype. The
adapters, their checkpoints (adapters only, the base named by the path and fingerprint of its
unquantised folder) and the peft export are LoRA's; the merged export dequantises the base
before folding the adapters in.
"""

from collections.abc import Mapping
from typing import Any

import torch

from src.models.language.lora.adapter import LoraAdapter, attach_lora
from src.models.language.lora.base import BASE_KEY, load_recorded_base
from src.models.language.lora.injection import merged_network
from src.models.language.lora.quantization import Backend, Quantization
from src.models.language.lora.spec import AdapterSpec
from src.models.language.qwen import QwenLM

QUANTIZATION_KEY = "quantization"  # the `adapter` values that make LoRA QLoRA


class QLoraAdapter(LoraAdapter):
    """LoRA adapters on a frozen QwenLM stored in 4 bits: checkpoints and exports as LoRA's.

    The base is quantised as soon as it is in the network: at once when the model was built from
    `model.pretrained`, else when a checkpoint's `complete_checkpoint` loads the base it names.
    """

    option = "qlora"

    def __init__(
        self,
        net: QwenLM,
        spec: AdapterSpec,
        base: dict[str, str] | None,
        quantization: Quantization,
    ):
        super().__init__(net, spec, base)
        self.quantization = quantization
        self.backend: Backend = quantization.backend_for()
        if base is not None:
            self.backend.quantize(net)

    def hyperparameters(self) -> dict[str, Any]:
        values = {**self.spec.to_dict(), QUANTIZATION_KEY: self.quantization.to_dict()}
        return {"adapter": values}

    def complete_checkpoint(self, checkpoint: dict[str, Any], module: torch.nn.Module) -> None:
        """As LoRA's, quantising the base once it is loaded (its 4-bit weights then fill in)."""
        recorded = checkpoint.get(BASE_KEY)
        if recorded is not None and self.base is None:
            self.base = load_recorded_base(self.net, recorded)
            self.backend.quantize(self.net)
        super().complete_checkpoint(checkpoint, module)

    def merged_network(self) -> QwenLM:
        """A plain QwenLM in the compute dtype: the base dequantised, the adapters folded in."""
        return merged_network(self.net, self.backend.dense_state(self.net))


def is_qlora(values: Mapping[str, Any]) -> bool:
    """Whether the `adapter` group's values describe QLoRA (they name a quantisation)."""
    return values.get(QUANTIZATION_KEY) is not None


def attach_qlora(net: QwenLM, values: Mapping[str, Any], pretrained: str | None) -> QLoraAdapter:
    """Freeze `net`, inject LoRA adapters, and store the base's linear weights in 4 bits.

    `values` are LoRA's (attach_lora) plus `quantization` (Quantization); `pretrained` is the
    folder `net` was just loaded from, None when the base is to come from a checkpoint.
    """
    values = dict(values)
    quantization = Quantization.from_dict(values.pop(QUANTIZATION_KEY))
    quantization.backend_for()  # a missing package refused before peft injects anything
    lora = attach_lora(net, values, pretrained)
    return QLoraAdapter(net, lora.spec, lora.base, quantization)
