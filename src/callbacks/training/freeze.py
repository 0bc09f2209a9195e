"""Freeze parts of a model by module name, and optionally unfreeze them later (fine-tuning)."""

import fnmatch
import logging
from collections.abc import Sized
from typing import cast

from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import BaseFinetuning
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim import Optimizer

from src.utils.contracts import HasAdapter
from src.utils.errors import ConfigError

log = logging.getLogger(__name__)


class FreezeLayers(BaseFinetuning):
    """Freeze the parameters of modules matching `freeze`, or of all modules but `train_only`.

    Patterns are shell-style (`conv*`, `layers.1?`) and match module names with or without
    the LightningModule's `net.` prefix: `train_only: [fc2]` trains only the last layer of
    SimpleNet/CNN, `[fc]` the head of model=resnet18, `[heads.head]` that of model=vit_b_16
    (with `train_bn: false` batch norms freeze too, running statistics included);
    `train_last_n: 2` trains only the last two blocks of `layers` (the module
    list of decoder layers, found by name when None: `net.model.layers` in the Qwen LM), plus
    whatever `train_only` names (e.g. `model.norm`, `lm_head`; with tied embeddings the head
    is `model.embed_tokens`). Frozen parameters never
    reach the optimizer; at `unfreeze_at_epoch` they join it with `unfreeze_lr_factor` x the
    base learning rate. It refuses a model whose adapter freezes its base itself (LoRA,
    `adapter=lora`).
    """

    def __init__(
        self,
        freeze: list[str] | None = None,
        train_only: list[str] | None = None,
        train_last_n: int | None = None,
        layers: str | None = None,
        unfreeze_at_epoch: int | None = None,
        unfreeze_lr_factor: float = 0.1,
        train_bn: bool = True,
    ):
        super().__init__()
        if bool(freeze) == (train_only is not None or train_last_n is not None):
            raise ValueError("Give either `freeze` patterns or `train_only`/`train_last_n`.")
        self.freeze_patterns = list(freeze or [])
        self.train_patterns = list(train_only or [])
        self.train_last_n = train_last_n
        self.layers = layers
        self.unfreeze_at_epoch = unfreeze_at_epoch
        self.unfreeze_lr_factor = unfreeze_lr_factor
        self.train_bn = train_bn
        self.frozen: list[nn.Module] = []

    def freeze_before_training(self, pl_module: LightningModule) -> None:
        if isinstance(pl_module, HasAdapter) and pl_module.adapter.freezes_base:
            raise ConfigError(
                "callbacks=freeze and adapter=lora do not combine: LoRA already freezes the "
                "whole base and trains only its adapters. Choose one; to adapt fewer modules, "
                "narrow adapter.target_modules (e.g. [q_proj,v_proj], or "
                "[layers.3.self_attn.q_proj] for one layer)."
            )
        self.frozen = self._modules_to_freeze(pl_module)
        # Each module's own parameters only: BaseFinetuning.freeze would also freeze every
        # child of a chosen parent (vit's `net` owns `class_token` and holds the new head).
        for module in self.frozen:
            if not (self.train_bn and isinstance(module, _BatchNorm)):
                self.freeze_module(module)
        frozen = sum(p.numel() for p in pl_module.parameters() if not p.requires_grad)
        total = sum(p.numel() for p in pl_module.parameters())
        log.info(
            "Frozen: %d of %d parameters (%d trainable) in %d modules",
            frozen,
            total,
            total - frozen,
            len(self.frozen),
        )

    def finetune_function(
        self, pl_module: LightningModule, epoch: int, optimizer: Optimizer
    ) -> None:
        if epoch == self.unfreeze_at_epoch:
            lr = optimizer.param_groups[0]["lr"] * self.unfreeze_lr_factor
            self.unfreeze_and_add_param_group(self.frozen, optimizer, lr=lr, train_bn=self.train_bn)
            log.info("Epoch %d: unfroze %d modules at lr %g", epoch, len(self.frozen), lr)

    def _modules_to_freeze(self, pl_module: LightningModule) -> list[nn.Module]:
        """Modules owning parameters directly, selected by name."""
        owners = [
            (name, module)
            for name, module in pl_module.named_modules()
            if any(True for _ in module.parameters(recurse=False))
        ]
        if self.freeze_patterns:
            chosen = [(n, m) for n, m in owners if self._matches(n, self.freeze_patterns)]
        else:
            trained = self.train_patterns + self._last_layer_patterns(pl_module)
            chosen = [(n, m) for n, m in owners if not self._matches(n, trained)]
        patterns = self.freeze_patterns or self.train_patterns
        if not chosen or len(chosen) == len(owners):
            names = ", ".join(name for name, _ in owners)
            raise ValueError(
                f"The patterns {patterns} select {len(chosen)} of {len(owners)} "
                f"modules with parameters; choose among: {names}"
            )
        return [module for _, module in chosen]

    def _last_layer_patterns(self, pl_module: LightningModule) -> list[str]:
        if self.train_last_n is None:
            return []
        path = self.layers or self._find_layers(pl_module)
        layers = cast(Sized, pl_module.get_submodule(path))  # a ModuleList (or Sequential)
        last = range(len(layers) - self.train_last_n, len(layers))
        return [f"{path}.{index}" for index in last]

    @staticmethod
    def _find_layers(pl_module: LightningModule) -> str:
        """The name of the model's stack of layers: the first ModuleList called `*layers`."""
        for name, module in pl_module.named_modules():
            if isinstance(module, nn.ModuleList) and name.split(".")[-1] == "layers":
                return name
        raise ValueError(
            f"{type(pl_module).__name__} has no ModuleList named `layers`: set "
            "callbacks.freeze.layers to the module list whose last blocks train_last_n counts"
        )

    @staticmethod
    def _matches(name: str, patterns: list[str]) -> bool:
        """True when the module or one of its parents matches a pattern."""
        candidates = {name, name.removeprefix("net.")}
        parts = name.split(".")
        candidates |= {".".join(parts[:i]) for i in range(1, len(parts))}
        candidates |= {c.removeprefix("net.") for c in set(candidates)}
        return any(fnmatch.fnmatchcase(c, p) for c in candidates for p in patterns)
