"""`model.objective=dpo`: a LanguageModel trained on preference pairs (data=preferences).

The loss is the mean over the step's pairs of `model.preference.loss_type` (losses.py). Logged
under train/ and val/ (and test/) as TRL names them: `loss`, `rewards/chosen`,
`rewards/rejected`, `rewards/margins` (chosen minus rejected), `rewards/accuracies` (the share
of pairs whose chosen reward is the higher), `logps/chosen` and `logps/rejected` (the policy's
summed log-probabilities), each a mean over pairs.
"""

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from src.models.language.objectives import ObjectiveSums, means_per_unit
from src.models.language.preference.losses import PreferenceLoss
from src.models.language.preference.reference import (
    AdaptersDisabled,
    CurrentNetwork,
    FrozenCopy,
    Precomputed,
    Reference,
)
from src.models.language.preference.sequences import response_logps
from src.utils.contracts import Adapter

PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


class PreferenceObjective(nn.Module):
    """A preference loss against a reference (none for SimPO and ORPO), and TRL's metrics.

    A module so that a frozen copy of the network, as the reference, is moved and checkpointed
    with the model.
    """

    step_metrics: tuple[str, ...] = PAIR_METRICS
    eval_sums: tuple[str, ...] = ("loss", "units", *PAIR_METRICS)
    eval_metrics: tuple[str, ...] = ("loss", *PAIR_METRICS)
    accuracy = "rewards/accuracies"

    def __init__(self, loss: PreferenceLoss, reference: Reference | None):
        super().__init__()
        self.loss = loss
        self.reference = reference

    @classmethod
    def build(
        cls, options: Mapping[str, Any], net: nn.Module, adapter: Adapter
    ) -> "PreferenceObjective":
        """The objective of `model.preference`'s options, for `net` as just built.

        Its reference: none for a reference-free loss; else the values the datamodule
        precomputes (`precomputed_reference`), the base under disabled adapters (LoRA), or a
        frozen copy of `net`.
        """
        options = dict(options)
        precomputed = options.pop("precomputed_reference", False)
        loss = PreferenceLoss(**options)
        if not loss.needs_reference:
            return cls(loss, None)
        base = AdaptersDisabled() if adapter.freezes_base else None
        if precomputed:
            return cls(loss, Precomputed(base or CurrentNetwork()))
        return cls(loss, base or FrozenCopy(net))

    def sums(self, net: nn.Module, batch: dict[str, torch.Tensor]) -> ObjectiveSums:
        # The reference's forward first: a mixture of experts' router statistics, which the
        # model reads after this, are then the policy's.
        reference = None if self.reference is None else self.reference.logps(net, batch)
        policy, lengths = response_logps(net, batch)
        losses, rewards = self.loss(policy, reference, lengths)
        per_pair = {
            "rewards/chosen": rewards.chosen,
            "rewards/rejected": rewards.rejected,
            "rewards/margins": rewards.chosen - rewards.rejected,
            "rewards/accuracies": (rewards.chosen > rewards.rejected).to(losses.dtype),
            "logps/chosen": policy.chosen.detach(),
            "logps/rejected": policy.rejected.detach(),
        }
        pairs = torch.tensor(len(losses), device=losses.device)
        return ObjectiveSums(losses.sum(), pairs, {k: v.sum() for k, v in per_pair.items()})

    def step_means(self, totals: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return means_per_unit(totals)

    def evaluation(self, sums: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each metric's mean over the split's pairs."""
        pairs = sums["units"].clamp_min(1)
        return {name: sums[name] / pairs for name in self.eval_metrics}

    def setup(self, net: nn.Module, datamodule: Any, device: torch.device) -> None:
        """Have the datamodule compute the reference log-probabilities, if they are precomputed."""
        if isinstance(self.reference, Precomputed):
            self.reference.prepare(net, datamodule, device)
