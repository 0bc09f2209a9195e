"""What a LanguageModel optimises (`model.objective`): next-token prediction, preferences, rewards.

Each is an `Objective`: it turns a batch into sums over its units (supervised tokens,
preference pairs, or completions), so that the model's loss is their mean over an optimizer
step however the units fall into micro-batches, and it names the metrics it logs. `next_token`
is pretraining and SFT; `dpo` is preference tuning (src/models/language/preference/); `grpo` is
reinforcement learning with verifiable rewards (src/models/language/grpo/).
"""

from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn


class ObjectiveSums(NamedTuple):
    """One batch's sums: the loss over its units, the units, and more sums over them."""

    loss: torch.Tensor  # summed over the units, in fp32 or wider
    units: torch.Tensor  # supervised tokens, or preference pairs
    metrics: dict[str, torch.Tensor]  # logged as their means over the units


class Objective(Protocol):
    """A LanguageModel's loss and metrics; `setup` runs before training or evaluating."""

    step_metrics: tuple[str, ...]  # logged as train/<name> each step, besides train/loss
    eval_sums: tuple[str, ...]  # what an evaluation adds up: loss, units and the metrics' sums
    eval_metrics: tuple[str, ...]  # what it logs as <stage>/<name> from them
    accuracy: str  # the eval metric whose best so far is val/acc_best

    def sums(self, net: nn.Module, batch: dict[str, torch.Tensor]) -> ObjectiveSums: ...

    # What a training step logs from its sums over micro-batches (and ranks): loss and more.
    def step_means(self, totals: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def evaluation(self, sums: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def setup(self, net: nn.Module, datamodule: Any, device: torch.device) -> None: ...


class NextToken:
    """`objective=next_token`: the cross-entropy of every supervised token (pretraining, SFT)."""

    step_metrics: tuple[str, ...] = ()
    eval_sums: tuple[str, ...] = ("loss", "units", "correct")
    eval_metrics: tuple[str, ...] = ("loss", "ppl", "acc")
    accuracy = "acc"

    def sums(self, net: nn.Module, batch: dict[str, torch.Tensor]) -> ObjectiveSums:
        loss_sum, tokens, correct = net(
            batch["input_ids"],
            position_ids=batch.get("position_ids"),
            cu_seqlens=batch.get("cu_seqlens"),
            labels=batch["labels"],
        )
        # Lightning evaluates without gradients, where the loss also counts the right argmaxes.
        return ObjectiveSums(loss_sum, tokens, {} if correct is None else {"correct": correct})

    def step_means(self, totals: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return means_per_unit(totals)

    def evaluation(self, sums: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The loss per supervised token over the whole split, its perplexity and accuracy.

        The accuracy is next-token accuracy; the exact-match accuracy of SFT data comes from the
        ExactMatch callback.
        """
        tokens = sums["units"].clamp_min(1)
        loss = sums["loss"] / tokens
        return {"loss": loss, "ppl": loss.exp(), "acc": sums["correct"] / tokens}

    def setup(self, net: nn.Module, datamodule: Any, device: torch.device) -> None:
        """Nothing to prepare."""


def means_per_unit(totals: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every sum but the units over the units: the loss and metrics per token or pair."""
    units = totals["units"].clamp_min(1)
    return {name: total / units for name, total in totals.items() if name != "units"}
