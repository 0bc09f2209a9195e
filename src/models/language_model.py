"""The LightningModule that trains a QwenLM on next-token prediction."""

import math
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torchmetrics import SumMetric

from src.models.qwen import QwenConfig, QwenLM
from src.utils.errors import ConfigError

IGNORE_INDEX = -100


class LanguageModel(LightningModule):
    """Cross-entropy on pre-shifted labels, AdamW, linear warmup then cosine decay per step.

    Batches are dicts: `input_ids` and `labels` [B, T] (labels[t] is the target of position t,
    -100 where nothing is supervised), optionally `position_ids` [B, T] and `cu_seqlens` (int32
    document offsets of packed rows).

    The training loss is the mean over every supervised token of the optimizer step, however the
    tokens fall into micro-batches (gradient accumulation, packing, devices): each micro-batch
    backpropagates its summed token losses over a normaliser fixed for the step (the label
    positions B*T of its first micro-batch, the same on every device), and just before the
    optimizer step, before gradient clipping, the accumulated gradient is rescaled by
    normaliser x micro-batches x devices / supervised tokens of the whole step. When every
    label is supervised the rescale is exactly 1. `train/loss` logs that step mean.

    `config` is a QwenConfig as a plain dict and the optimizer settings are plain values, so
    checkpoints load with `torch.load(weights_only=True)`. `pretrained`, a transformers-format
    folder (e.g. a released Qwen3 checkpoint) whose config.json matches `config`, gives the
    starting weights; checkpoints do not need it afterwards.
    """

    def __init__(
        self,
        config: dict[str, Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.1,
        pretrained: str | None = None,
    ):
        super().__init__()
        qwen_config = QwenConfig.from_dict(dict(config))
        hyperparameters = {
            "config": qwen_config.to_dict(),
            "lr": float(lr),
            "weight_decay": float(weight_decay),
            "betas": [float(b) for b in betas],
            "warmup_steps": int(warmup_steps),
            "min_lr_ratio": float(min_lr_ratio),
        }
        self.save_hyperparameters(hyperparameters, logger=False)
        self.net = QwenLM(qwen_config)
        if pretrained:
            self.net.load_hf_weights(pretrained)
        self.eval_loss_sums = nn.ModuleDict({s: SumMetric() for s in ("val", "test")})
        self.eval_token_counts = nn.ModuleDict({s: SumMetric() for s in ("val", "test")})
        self._reset_step()

    def forward(self, input_ids, position_ids=None, cu_seqlens=None) -> torch.Tensor:
        return self.net(input_ids, position_ids=position_ids, cu_seqlens=cu_seqlens)

    def setup(self, stage: str) -> None:
        vocab = getattr(getattr(self.trainer, "datamodule", None), "vocab_size", None)
        if vocab is not None and vocab > self.net.config.vocab_size:
            raise ConfigError(
                f"The data has {vocab} token ids but the model's vocab_size is "
                f"{self.net.config.vocab_size}: raise model.config.vocab_size to at least {vocab}"
            )

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss_sum, tokens = self._summed_loss(batch)
        if self._step_normaliser is None:
            self._step_normaliser = batch["labels"].numel()
        self._step_loss_sum = self._step_loss_sum + loss_sum.detach()
        self._step_tokens = self._step_tokens + tokens
        return loss_sum / self._step_normaliser

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Turn the accumulated gradient into that of the mean loss over the step's tokens."""
        strategy = self.trainer.strategy
        tokens = strategy.reduce(self._step_tokens.float(), reduce_op="sum").clamp_min(1)
        loss_sum = strategy.reduce(self._step_loss_sum, reduce_op="sum")
        # Lightning divided each micro-batch loss by accumulate_grad_batches; DDP averages devices.
        micro_batches = self.trainer.accumulate_grad_batches * self.trainer.world_size
        scale = (self._step_normaliser * micro_batches / tokens).item()
        if scale != 1.0:
            for parameter in self.parameters():
                if parameter.grad is not None:
                    parameter.grad.mul_(scale)
        self.log("train/loss", loss_sum / tokens, on_step=True, prog_bar=True)
        self._reset_step()

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._accumulate_eval("val", batch)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._accumulate_eval("test", batch)

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val")

    def on_test_epoch_end(self) -> None:
        self._log_eval("test")

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW with weight decay on matrices only (not on norms, biases or the DeltaNet gates)."""
        hp = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": hp.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas))
        schedule = partial(
            warmup_cosine,
            warmup_steps=hp.warmup_steps,
            total_steps=self.trainer.estimated_stepping_batches,
            min_lr_ratio=hp.min_lr_ratio,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def _summed_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the token losses, number of supervised tokens) of one batch."""
        logits = self(batch["input_ids"], batch.get("position_ids"), batch.get("cu_seqlens"))
        labels = batch["labels"]
        loss_sum = F.cross_entropy(
            logits.flatten(0, 1).float(),
            labels.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        return loss_sum, (labels != IGNORE_INDEX).sum()

    def _accumulate_eval(self, stage: str, batch: dict[str, torch.Tensor]) -> None:
        loss_sum, tokens = self._summed_loss(batch)
        self.eval_loss_sums[stage].update(loss_sum)
        self.eval_token_counts[stage].update(tokens)

    def _log_eval(self, stage: str) -> None:
        """Loss per supervised token over the whole split, and its perplexity."""
        loss = self.eval_loss_sums[stage].compute() / self.eval_token_counts[
            stage
        ].compute().clamp_min(1)
        self.log(f"{stage}/loss", loss, prog_bar=stage == "val")
        self.log(f"{stage}/ppl", loss.exp(), prog_bar=stage == "val")
        self.eval_loss_sums[stage].reset()
        self.eval_token_counts[stage].reset()

    def _reset_step(self) -> None:
        self._step_normaliser: int | None = None
        self._step_loss_sum: torch.Tensor | float = 0.0  # becomes a tensor on the batch's device
        self._step_tokens: torch.Tensor | int = 0


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning-rate multiplier: linear from 1/warmup_steps to 1, then a cosine to min_lr_ratio."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
