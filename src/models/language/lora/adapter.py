"""The LoRA adapter of a LanguageModel (`adapter=lora`).

It is the `Adapter` of src/utils/contracts.py for adapters trained on a frozen pretrained base.
"""

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from src.models.language.lora.base import (
    BASE_KEY,
    base_identity,
    check_same_base,
    complete_state_dict,
    load_recorded_base,
    strip_base,
)
from src.models.language.lora.injection import inject, load_adapter_state, merged_network
from src.models.language.lora.peft_folder import read_peft_folder, save_peft_folder
from src.models.language.lora.spec import AdapterSpec
from src.models.language.qwen import QwenLM
from src.utils.errors import CheckpointError, ConfigError

NO_BASE = (
    "adapter={option} trains adapters on a pretrained base, and this model has none: set "
    "model.pretrained=<transformers folder> (to fine-tune a randomly initialised model, "
    "train it whole, without an adapter)."
)


class LoraAdapter:
    """LoRA adapters injected into a frozen QwenLM: their spec and the identity of their base.

    The spec is as built, after reading `path`; the base's identity is None until a base is
    loaded.

    Only the adapters train; checkpoints hold them and name the base (`adapter_base`: path and
    fingerprint) instead of holding its weights again, and loading one puts the base back.
    """

    freezes_base = True
    option = "lora"  # the `adapter` config group's option

    def __init__(self, net: QwenLM, spec: AdapterSpec, base: dict[str, str] | None):
        self.net = net
        self.spec = spec
        self.base = base

    def hyperparameters(self) -> dict[str, Any]:
        return {"adapter": self.spec.to_dict()}  # what load_from_checkpoint rebuilds it from

    def check_can_train(self) -> None:
        if self.base is None:
            raise ConfigError(NO_BASE.format(option=self.option))

    def strip_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Drop the frozen base's weights from a Lightning checkpoint and name the base."""
        self.check_can_train()
        assert self.base is not None  # check_can_train raised otherwise
        strip_base(checkpoint, self.base)

    def complete_checkpoint(self, checkpoint: dict[str, Any], module: torch.nn.Module) -> None:
        """Put the base's weights back into an adapter checkpoint's state dicts (in place).

        The base is first checked to be the one it was trained on, and loaded before that when
        the network has none yet (a model rebuilt without `model.pretrained`).
        """
        recorded = checkpoint.get(BASE_KEY)
        if recorded is None:
            return  # a whole-model checkpoint: nothing was left out
        if self.base is None:
            self.base = load_recorded_base(self.net, recorded)
        check_same_base(self.base, recorded)
        complete_state_dict(checkpoint, module.state_dict())

    def merged_network(self) -> QwenLM:
        """A plain QwenLM with the adapters folded into its weights."""
        return merged_network(self.net)

    def save_peft(self, folder: Path) -> None:
        save_peft_folder(self.net, self.spec, self.base, folder)


def attach_lora(net: QwenLM, values: Mapping[str, Any], pretrained: str | None) -> LoraAdapter:
    """Freeze `net` and inject LoRA adapters (loaded from `values["path"]` when given).

    `pretrained` is the base folder `net` was just loaded from; None when the base is to come
    from a checkpoint (restoring a run: `LoraAdapter.complete_checkpoint` loads it then).
    """
    spec = AdapterSpec.from_dict(values)
    base = base_identity(pretrained) if pretrained else None
    state = None
    if spec.path:
        spec, state, trained_on = read_peft_folder(spec, net)
        if base and trained_on and trained_on != base["fingerprint"]:
            raise CheckpointError(
                f"adapter.path={spec.path}: these adapters were trained on a base with "
                f"fingerprint {trained_on}, but model.pretrained={pretrained} has "
                f"{base['fingerprint']}. Start from the base they were trained on."
            )
    inject(net, spec)
    if state is not None:
        assert spec.path is not None  # state was read from that folder
        load_adapter_state(net, state, spec.path)
    return LoraAdapter(net, replace(spec, path=None), base)
