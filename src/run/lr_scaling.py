"""The learning rate scaled with the effective batch, when the config asks for it.

`+optimizer.scale_lr=linear` (or `sqrt`) with `+optimizer.reference_batch_size=64` multiplies
the learning rate by effective batch / 64 (or its square root), where the effective batch is
data.batch_size x devices x num_nodes x accumulate_grad_batches. The learning rate is
`optimizer.lr`, for every model. train.py applies it before anything is built.
"""

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, open_dict

from src.utils.errors import ConfigError

# The optimizer's keys that set its learning rate's scaling, taken out before it is built.
LR_SCALING_KEYS = ("scale_lr", "reference_batch_size")

log = logging.getLogger(__name__)

RULES = {"linear": lambda ratio: ratio, "sqrt": math.sqrt}


def scaled_lr(lr: float, batch: int, reference_batch: int, rule: str) -> float:
    """`lr` tuned at `reference_batch`, scaled to `batch` by `rule` ("linear" or "sqrt")."""
    return lr * RULES[rule](batch / reference_batch)


def devices_per_node(devices: Any, accelerator: str) -> int:
    """How many processes per node `Trainer(devices=..., accelerator=...)` starts."""
    if isinstance(devices, Sequence) and not isinstance(devices, str):
        return len(devices)  # device ids
    text = str(devices).strip()
    if "," in text:
        return len([index for index in text.split(",") if index.strip()])
    if text in ("-1", "auto"):
        uses_gpus = accelerator != "cpu" and torch.cuda.is_available()
        return torch.cuda.device_count() if uses_gpus else 1
    return int(text)


def effective_batch_size(cfg: DictConfig) -> int:
    """Samples per optimizer step: batch size x devices x nodes x accumulation."""
    trainer = cfg.trainer
    devices = devices_per_node(trainer.get("devices", 1), str(trainer.get("accelerator", "auto")))
    nodes = trainer.get("num_nodes") or 1
    return cfg.data.batch_size * devices * nodes * (trainer.get("accumulate_grad_batches") or 1)


def apply_lr_scaling(cfg: DictConfig) -> None:
    """Scale `cfg.optimizer.lr` in place when `scale_lr` is set.

    `scale_lr` and `reference_batch_size` are taken out of `cfg.optimizer`: the optimizer never
    sees them.
    """
    if not cfg.get("optimizer"):
        return
    with open_dict(cfg.optimizer):
        rule, reference = (cfg.optimizer.pop(key, None) for key in LR_SCALING_KEYS)
    if rule is None:
        return
    if rule not in RULES:
        raise ConfigError(f"optimizer.scale_lr={rule!r} is not a rule: use one of {list(RULES)}.")
    if not isinstance(reference, int) or reference < 1:
        raise ConfigError(
            f"optimizer.scale_lr={rule} needs the batch size the learning rate was tuned at: "
            f"+optimizer.reference_batch_size=<int>, got {reference!r}."
        )
    lr = cfg.optimizer.get("lr")
    if lr is None:
        raise ConfigError(
            f"optimizer.scale_lr={rule} found no learning rate to scale: set optimizer.lr."
        )
    batch = effective_batch_size(cfg)
    scaled = scaled_lr(lr, batch, reference, rule)
    if rank_zero_only.rank == 0:  # type: ignore[attr-defined]  # set by Lightning on the function
        log.info(
            f"optimizer.lr {lr:g} scaled to {scaled:g} for effective batch {batch} "
            f"(reference {reference}, {rule})"
        )
    cfg.optimizer.lr = scaled
