"""The optimizer contract of every LightningModule here, and the warmup-cosine schedule.

A module takes `optimizer`, a partial optimizer (`conf/optimizer/`, `_partial_: true`), and
`scheduler`, None or Lightning's lr-scheduler dict whose `scheduler` entry is a partial called
with the optimizer (`conf/scheduler/`). `OptimizedModule.configure_optimizers` builds both, the
same way for the image classifiers and the language models.
"""

import inspect
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch.optim.lr_scheduler import LambdaLR

from src.utils.errors import ConfigError

OptimizerFactory = Callable[..., torch.optim.Optimizer]
# Segments that wrappers insert into parameter names after `__init__`: FSDP's units, activation
# checkpointing, a wrapping torch.compile.
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


class OptimizedModule(LightningModule):
    """A LightningModule trained with the optimizer and lr scheduler of the config groups.

    The optimizer receives every trainable parameter in one group, unless the subclass declares
    `no_weight_decay`, the names (as `named_parameters()` gives them in `__init__`) of the
    parameters to train without weight decay: then it receives two groups, the others with the
    optimizer's own `weight_decay` and those at 0. Names, not shapes, because FSDP flattens
    parameters to 1-D before `configure_optimizers` runs.

    A scheduler factory that takes a `total_steps` argument also receives `self.total_steps`, a
    callable that asks the Trainer for the run's optimizer steps when first called (see
    `warmup_cosine_schedule`); any other factory is called with the optimizer alone.
    """

    no_weight_decay: frozenset[str] | None = None

    def __init__(self, optimizer: OptimizerFactory | None, scheduler: dict[str, Any] | None):
        super().__init__()
        self.optimizer_factory = optimizer
        self.scheduler_config = scheduler
        self._total_steps: float | None = None

    def configure_optimizers(self) -> Any:
        if self.optimizer_factory is None:
            raise ConfigError(
                f"{type(self).__name__} was built without an optimizer, so it cannot train: "
                f"set model.optimizer (train.py's model configs use `optimizer: ${{optimizer}}`)."
            )
        optimizer = self.optimizer_factory(self.param_groups())
        if not self.scheduler_config:
            return optimizer
        lr_scheduler = dict(self.scheduler_config)
        factory = lr_scheduler["scheduler"]
        if "total_steps" in inspect.signature(factory).parameters:
            lr_scheduler["scheduler"] = factory(optimizer, total_steps=self.total_steps)
        else:
            lr_scheduler["scheduler"] = factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": lr_scheduler}

    def param_groups(self) -> list[torch.nn.Parameter] | list[dict[str, Any]]:
        """The trainable parameters, in `parameters()` order, split by `no_weight_decay`."""
        named = [(name, p) for name, p in self.named_parameters() if p.requires_grad]
        if self.no_weight_decay is None:
            return [p for _, p in named]
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for name, parameter in named:
            exempt = unwrapped_name(name) in self.no_weight_decay
            (no_decay if exempt else decay).append(parameter)
        groups: list[dict[str, Any]] = [
            {"params": decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return groups

    def total_steps(self) -> float:
        """The run's optimizer steps, asked of the Trainer only once training has begun.

        Asking in `configure_optimizers` would drop the resumed data loader's position
        (Lightning #20550, in epoch-based runs). Infinite when neither max_steps nor max_epochs
        is set.
        """
        if self._total_steps is None:
            self._total_steps = float(self.trainer.estimated_stepping_batches)
        return self._total_steps


def unwrapped_name(name: str) -> str:
    """A parameter's name as the unwrapped module has it."""
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def warmup_cosine_schedule(
    optimizer: torch.optim.Optimizer,
    total_steps: Callable[[], float],
    warmup_steps: int,
    min_lr_ratio: float,
) -> LambdaLR:
    """Linear warmup over `warmup_steps`, then a cosine decay to `min_lr_ratio` x lr.

    The decay ends at `total_steps()`; step it every optimizer step (`interval: step`).
    """
    schedule = partial(
        warmup_cosine,
        warmup_steps=int(warmup_steps),
        total_steps=total_steps,
        min_lr_ratio=float(min_lr_ratio),
    )
    # A partial (its __dict__ is empty), not an object holding `total_steps`: LambdaLR saves a
    # callable object's __dict__, and a bound method there would make checkpoints unloadable
    # with weights_only=True.
    return LambdaLR(optimizer, schedule)


def warmup_cosine(
    step: int, warmup_steps: int, total_steps: Callable[[], float], min_lr_ratio: float
) -> float:
    """Learning-rate multiplier: linear from 1/warmup_steps to 1, then a cosine to min_lr_ratio.

    The cosine ends at `total_steps()` (called only after the warmup).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step == warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps() - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
