"""The LightningModule that trains a QwenLM on next-token prediction."""

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torchmetrics import MaxMetric, SumMetric

from src.models.exact_match import count_exact_matches
from src.models.parallel import shard_decoder_layers
from src.models.qwen import QwenConfig, QwenLM
from src.utils.errors import ConfigError

IGNORE_INDEX = -100
# Summed over a validation or test split: token losses, supervised tokens, tokens predicted
# right (argmax), and for SFT data the prompts answered exactly and the prompts asked.
EVAL_SUMS = ("loss", "tokens", "correct", "exact", "prompts")


class LanguageModel(LightningModule):
    """Cross-entropy on pre-shifted labels, AdamW, linear warmup then cosine decay per step.

    Batches are dicts: `input_ids` and `labels` [B, T] (labels[t] is the target of position t,
    -100 where nothing is supervised), optionally `position_ids` [B, T] and `cu_seqlens` (int32
    document offsets of packed rows).

    The training loss is the mean over every supervised token of the optimizer step, however the
    tokens fall into micro-batches (gradient accumulation, packing, devices): each micro-batch
    backpropagates its summed token losses over a normaliser fixed for the step (the rows B of
    its first micro-batch, the same on every device), and just before the optimizer step,
    before gradient clipping, the accumulated gradient is rescaled by normaliser x
    micro-batches x devices / supervised tokens of the whole step. `train/loss` logs that step
    mean.

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
        self.eval_sums = nn.ModuleDict(
            {stage: nn.ModuleDict({n: SumMetric() for n in EVAL_SUMS}) for stage in ("val", "test")}
        )
        self.val_acc_best = MaxMetric()
        self.val_acc_best.persistent(True)  # in checkpoints, so a resumed run keeps its best
        self._total_steps: float | None = None
        self._reset_step()

    def forward(self, input_ids, position_ids=None, cu_seqlens=None) -> torch.Tensor:
        return self.net(input_ids, position_ids=position_ids, cu_seqlens=cu_seqlens)

    def configure_model(self) -> None:
        """Shard the decoder layers under FSDP2 (`trainer=model_parallel`); a no-op otherwise."""
        shard_decoder_layers(self.net, self.device_mesh)

    def flops_per_batch(self, batch: dict[str, torch.Tensor]) -> float:
        """Training FLOPs of a batch, per token slot (what the Throughput callback's MFU uses)."""
        rows, length = batch["input_ids"].shape
        return rows * length * self.net.flops_per_token(length)

    def setup(self, stage: str) -> None:
        vocab = getattr(getattr(self.trainer, "datamodule", None), "vocab_size", None)
        if vocab is not None and vocab > self.net.config.vocab_size:
            raise ConfigError(
                f"The data has {vocab} token ids but the model's vocab_size is "
                f"{self.net.config.vocab_size}: raise model.config.vocab_size to at least {vocab}"
            )

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        _, loss_sum, tokens = self._summed_loss(batch)
        if self._step_normaliser is None:
            # Rows, not B*T: every rank's micro-batches hold the same number of rows, while
            # padded rows may differ in length between ranks.
            self._step_normaliser = batch["labels"].shape[0]
        self._step_loss_sum = self._step_loss_sum + loss_sum.detach()
        self._step_tokens = self._step_tokens + tokens
        return loss_sum / self._step_normaliser

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Turn the accumulated gradient into that of the mean loss over the step's tokens."""
        # Both sums in one all-reduce, straight to the process group: Lightning's
        # strategy.reduce adds a barrier, a second collective per step.
        dtype = torch.promote_types(self._step_loss_sum.dtype, torch.float32)
        sums = torch.stack([self._step_tokens.to(dtype), self._step_loss_sum.to(dtype)])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(sums)
        tokens, loss_sum = sums[0].clamp_min(1), sums[1]
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
            total_steps=self.total_steps,
            min_lr_ratio=hp.min_lr_ratio,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def total_steps(self) -> float:
        """The run's optimizer steps, asked of the Trainer only once training has begun: asking
        in `configure_optimizers` would drop the resumed data loader's position (Lightning
        #20550, in epoch-based runs). Infinite when neither max_steps nor max_epochs is set."""
        if self._total_steps is None:
            self._total_steps = float(self.trainer.estimated_stepping_batches)
        return self._total_steps

    def _summed_loss(self, batch: dict[str, torch.Tensor]):
        """(logits, sum of the token losses, number of supervised tokens) of one batch."""
        logits = self(batch["input_ids"], batch.get("position_ids"), batch.get("cu_seqlens"))
        labels = batch["labels"]
        loss_sum = F.cross_entropy(
            logits.flatten(0, 1).float(),
            labels.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        return logits, loss_sum, (labels != IGNORE_INDEX).sum()

    def _accumulate_eval(self, stage: str, batch: dict[str, torch.Tensor]) -> None:
        logits, loss_sum, tokens = self._summed_loss(batch)
        sums = self.eval_sums[stage]
        sums["loss"].update(loss_sum)
        sums["tokens"].update(tokens)
        sums["correct"].update((logits.argmax(-1) == batch["labels"]).sum())

    def _log_eval(self, stage: str) -> None:
        """Loss per supervised token over the whole split, its perplexity, next-token accuracy
        and, for SFT data, the exact-match accuracy of greedy answers."""
        sums = self.eval_sums[stage]
        tokens = sums["tokens"].compute().clamp_min(1)
        loss = sums["loss"].compute() / tokens
        accuracy = sums["correct"].compute() / tokens
        self.log(f"{stage}/loss", loss, prog_bar=stage == "val")
        self.log(f"{stage}/ppl", loss.exp())
        self.log(f"{stage}/acc", accuracy)
        if stage == "val" and not self.trainer.sanity_checking:
            self.val_acc_best(accuracy)
            self.log("val/acc_best", self.val_acc_best.compute())
        if self._count_exact_matches(stage):
            exact = sums["exact"].compute() / sums["prompts"].compute().clamp_min(1)
            self.log(f"{stage}/exact_match", exact, prog_bar=stage == "val")
        for metric in sums.values():
            metric.reset()

    def _count_exact_matches(self, stage: str) -> bool:
        """Answer this rank's share of the datamodule's exact-match prompts greedily (SFT data
        provides them; not during the sanity check). False when there are none."""
        datamodule = getattr(self.trainer, "datamodule", None)
        if self.trainer.sanity_checking or not hasattr(datamodule, "exact_match_examples"):
            return False
        examples = datamodule.exact_match_examples(stage)
        mine = examples[self.global_rank :: self.trainer.world_size]
        correct = count_exact_matches(self.net, datamodule.tokenizer, mine)
        self.eval_sums[stage]["exact"].update(torch.tensor(float(correct), device=self.device))
        self.eval_sums[stage]["prompts"].update(torch.tensor(float(len(mine)), device=self.device))
        return bool(examples)

    def _reset_step(self) -> None:
        self._step_normaliser: int | None = None
        self._step_loss_sum: torch.Tensor | float = 0.0  # becomes a tensor on the batch's device
        self._step_tokens: torch.Tensor | int = 0


def warmup_cosine(
    step: int, warmup_steps: int, total_steps: Callable[[], float], min_lr_ratio: float
) -> float:
    """Learning-rate multiplier: linear from 1/warmup_steps to 1, then a cosine to min_lr_ratio
    at `total_steps()` (called only after the warmup)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step == warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps() - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
