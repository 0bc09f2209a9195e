"""GRPO's advantages and clipped surrogate loss, with TRL's loss aggregations.

With group rewards r (the `num_generations` completions of one prompt) the advantage of each
completion is (r - mean(r)) / (std(r) + 1e-4), or r - mean(r) without `scale_rewards` (as Dr.
GRPO recommends). Per completion token, with the probability ratio rho = pi / pi_old,

    loss_t = -min(rho * A, clip(rho, 1 - epsilon, 1 + epsilon_high) * A) + beta * KL_t,

KL_t = exp(ref - logp) - (ref - logp) - 1 (the k3 estimator, always >= 0). Aggregated as
`loss_type` says (TRL's names):

- `grpo`: each completion's mean over its tokens, then the mean over completions;
- `dr_grpo`: the sum over all tokens over (completions x max_completion_length), so that long
  completions are not favoured by a per-sequence mean;
- `dapo`: the mean over every completion token of the optimizer step.

Each is a sum over its units (completions, or tokens for `dapo`) for the LanguageModel to divide
by the step's units, however the completions fall into micro-batches.
"""

from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")


@dataclass(frozen=True)
class SurrogateOptions:
    """The clipped surrogate's options (module docstring)."""

    epsilon: float = 0.2
    epsilon_high: float | None = None  # DAPO's clip-higher; None is epsilon
    beta: float = 0.0
    loss_type: str = "dapo"
    max_completion_length: int = 256


def group_advantages(
    rewards: torch.Tensor, group: int, scale: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion's advantage [N], and the std of its group's rewards [N].

    `rewards` [N] are prompt-major: `group` completions of each prompt in a row.
    """
    grouped = rewards.view(-1, group)
    std = grouped.std(dim=1, keepdim=True)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        advantages = advantages / (std + 1e-4)
    return advantages.flatten(), std.expand_as(grouped).flatten()


def surrogate_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    reference_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    options: SurrogateOptions,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The loss summed over its units, the units, and token sums (clipped tokens, KL).

    `logps`, `old_logps` and `reference_logps` are [N, T] per-token log-probabilities (0 where
    `mask` [N, T] is False, off the completions); `advantages` [N].
    """
    mask = mask.to(logps.dtype)
    low, high = 1 - options.epsilon, 1 + (options.epsilon_high or options.epsilon)
    ratio = torch.exp(logps - old_logps)
    advantage = advantages[:, None].to(logps.dtype)
    per_token = -torch.min(ratio * advantage, ratio.clamp(low, high) * advantage)
    sums = {}
    if reference_logps is not None:
        log_ratio = reference_logps - logps
        kl = torch.exp(log_ratio) - log_ratio - 1
        per_token = per_token + options.beta * kl
        sums["kl"] = (kl * mask).sum().detach()
    clipped = ((ratio < low) & (advantage < 0)) | ((ratio > high) & (advantage > 0))
    sums["clipped_tokens"] = (clipped * mask).sum().detach()
    per_token = per_token * mask
    tokens = mask.sum(dim=1)
    completions = torch.tensor(float(len(logps)), device=logps.device)
    if options.loss_type == "grpo":
        return (per_token.sum(dim=1) / tokens.clamp_min(1)).sum(), completions, sums
    if options.loss_type == "dr_grpo":
        return per_token.sum() / options.max_completion_length, completions, sums
    return per_token.sum(), tokens.sum(), sums
