"""Preference losses by their published formulas, one loss per pair of responses.

Every formula takes log-probabilities of the chosen (c) and rejected (r) responses summed over
each response's tokens (`Pair`s of [P] tensors), and their lengths in tokens. With the policy's
log-ratios to the reference, rho = log pi(y|x) - log pi_ref(y|x), and h = rho_c - rho_r:

- `sigmoid`, DPO (Rafailov et al. 2023, eq. 7): -logsigmoid(beta * h). With `label_smoothing`
  e, each preference is taken as flipped with probability e (conservative DPO):
  -(1 - e) logsigmoid(beta * h) - e logsigmoid(-beta * h).
- `ipo` (Azar et al. 2023, eq. 17): (h - 1 / (2 beta))^2, with h taken over the log-ratios per
  response token, as TRL computes it (sums would make the square grow with the length).
- `hinge`, SLiC (Zhao et al. 2023): max(0, 1 - beta * h).
- `simpo` (Meng et al. 2024, eq. 6), reference-free: -logsigmoid(beta * (m_c - m_r) - gamma),
  m the mean log-probability per token and gamma `simpo_gamma`; label smoothing as for DPO.
- `orpo` (Hong et al. 2024, eqs. 6-7), reference-free: -m_c - beta * logsigmoid(log odds_c -
  log odds_r), odds = p / (1 - p) with p = exp(m): the chosen response's negative
  log-likelihood per token plus beta (the paper's lambda) times the odds-ratio term.

The implicit rewards logged beside them are TRL's: beta * rho for the losses with a reference,
beta * m for SimPO and ORPO.
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from src.utils.errors import ConfigError

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")
SMOOTHED = ("sigmoid", "simpo")  # the losses that take label_smoothing


class Pair(NamedTuple):
    """One value per pair for its chosen and its rejected response: [P] tensors each."""

    chosen: torch.Tensor
    rejected: torch.Tensor


def sigmoid_loss(policy: Pair, reference: Pair, beta: float, label_smoothing: float = 0.0):
    h = (policy.chosen - reference.chosen) - (policy.rejected - reference.rejected)
    return smoothed_logistic(beta * h, label_smoothing)


def ipo_loss(policy: Pair, reference: Pair, lengths: Pair, beta: float) -> torch.Tensor:
    h = (policy.chosen - reference.chosen) / lengths.chosen.clamp_min(1) - (
        policy.rejected - reference.rejected
    ) / lengths.rejected.clamp_min(1)
    return (h - 1 / (2 * beta)) ** 2


def hinge_loss(policy: Pair, reference: Pair, beta: float) -> torch.Tensor:
    h = (policy.chosen - reference.chosen) - (policy.rejected - reference.rejected)
    return torch.relu(1 - beta * h)


def simpo_loss(
    policy: Pair, lengths: Pair, beta: float, gamma: float, label_smoothing: float = 0.0
) -> torch.Tensor:
    chosen, rejected = per_token(policy, lengths)
    return smoothed_logistic(beta * (chosen - rejected) - gamma, label_smoothing)


def orpo_loss(policy: Pair, lengths: Pair, beta: float) -> torch.Tensor:
    chosen, rejected = per_token(policy, lengths)
    # log odds(p) = log p - log(1 - p), with log(1 - e^l) computed stably for l < 0
    log_odds_ratio = (chosen - log1mexp(chosen)) - (rejected - log1mexp(rejected))
    return -chosen - beta * F.logsigmoid(log_odds_ratio)


def smoothed_logistic(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-log sigmoid(logits), the preference taken as flipped with probability `label_smoothing`."""
    return -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def per_token(logps: Pair, lengths: Pair) -> Pair:
    """Summed log-probabilities as means over each response's tokens."""
    return Pair(
        logps.chosen / lengths.chosen.clamp_min(1), logps.rejected / lengths.rejected.clamp_min(1)
    )


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, accurate near 0 and far below it (Mächler 2012)."""
    return torch.where(x > -0.6931, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


@dataclass(frozen=True)
class PreferenceLoss:
    """One of the losses above with its options, named as TRL names them.

    `beta` is DPO's β (IPO's τ, ORPO's λ); `label_smoothing` applies to sigmoid and simpo;
    `simpo_gamma` is SimPO's target margin (gamma).
    """

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(
                f"model.preference.loss_type={self.loss_type!r}: choose one of {LOSS_TYPES}"
            )
        if self.beta <= 0:
            raise ConfigError(f"model.preference.beta={self.beta}: give a positive number")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(
                f"model.preference.label_smoothing={self.label_smoothing}: give the share of "
                f"preferences taken as flipped, in [0, 0.5)"
            )
        if self.label_smoothing and self.loss_type not in SMOOTHED:
            raise ConfigError(
                f"model.preference.label_smoothing applies to the loss types {SMOOTHED}, not "
                f"{self.loss_type!r}: set it to 0"
            )

    @property
    def needs_reference(self) -> bool:
        return self.loss_type not in REFERENCE_FREE

    def __call__(
        self, policy: Pair, reference: Pair | None, lengths: Pair
    ) -> tuple[torch.Tensor, Pair]:
        """Each pair's loss [P], and the implicit rewards of its responses (detached)."""
        if self.loss_type == "simpo":
            losses = simpo_loss(policy, lengths, self.beta, self.simpo_gamma, self.label_smoothing)
            return losses, self._rewards(per_token(policy, lengths))
        if self.loss_type == "orpo":
            return orpo_loss(policy, lengths, self.beta), self._rewards(per_token(policy, lengths))
        assert reference is not None  # needs_reference: the objective supplies one
        if self.loss_type == "sigmoid":
            losses = sigmoid_loss(policy, reference, self.beta, self.label_smoothing)
        elif self.loss_type == "ipo":
            losses = ipo_loss(policy, reference, lengths, self.beta)
        else:
            losses = hinge_loss(policy, reference, self.beta)
        log_ratios = Pair(policy.chosen - reference.chosen, policy.rejected - reference.rejected)
        return losses, self._rewards(log_ratios)

    def _rewards(self, values: Pair) -> Pair:
        return Pair(self.beta * values.chosen.detach(), self.beta * values.rejected.detach())
