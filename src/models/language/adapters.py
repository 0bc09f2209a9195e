"""The adapter of a LanguageModel, chosen by the `adapter` config group: LoRA, QLoRA or none.

LoRA is `adapter=lora`, QLoRA (LoRA on a 4-bit base) `adapter=qlora`
(src/models/language/lora/). Each is the `Adapter` of
src/utils/contracts.py, which the model asks what its checkpoints keep and how its network is
exported, so that neither the model nor its callers test which one it holds.
"""

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from src.models.language.lora.adapter import attach_lora
from src.models.language.lora.qlora import attach_qlora, is_qlora
from src.models.language.qwen import QwenLM
from src.utils.contracts import Adapter
from src.utils.errors import CheckpointError


class NoAdapter:
    """No adapter (`adapter=none`): every weight trains, and checkpoints hold the whole network."""

    freezes_base = False

    def __init__(self, net: nn.Module):
        self.net = net

    def hyperparameters(self) -> dict[str, Any]:
        return {}

    def check_can_train(self) -> None:
        """Any network trains whole, pretrained or not."""

    def strip_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Checkpoints keep every weight."""

    def complete_checkpoint(self, checkpoint: dict[str, Any], module: nn.Module) -> None:
        """Checkpoints hold every weight already."""

    def merged_network(self) -> nn.Module:
        return self.net

    def save_peft(self, folder: Path) -> None:
        raise CheckpointError(
            "format=peft writes LoRA adapters, and this checkpoint has none: it is a run "
            "without adapter=lora. Export it with format=merged (a transformers folder) or "
            "format=safetensors."
        )


def build_adapter(net: QwenLM, values: Mapping[str, Any] | None, pretrained: str | None) -> Adapter:
    """The adapter that the `adapter` group's values describe, attached to `net`.

    QLoRA when they name a `quantization`, LoRA when the values are given, none otherwise. `net`
    was loaded from `pretrained`, which is None when the base is to come from a checkpoint.
    """
    if not values:
        return NoAdapter(net)
    if is_qlora(values):
        return attach_qlora(net, values, pretrained)
    return attach_lora(net, values, pretrained)
