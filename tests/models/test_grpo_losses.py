"""GRPO's advantages and clipped surrogate (src/models/language/grpo/losses.py) against the
formulas written out again per completion and per token in float64 Python: group-normalised
advantages (Shao et al. 2024), the clipped ratio, the k3 KL estimator, and TRL's `grpo`,
`dr_grpo` and `dapo` aggregations."""

import math
import statistics

import pytest
import torch

from src.models.language.grpo.losses import SurrogateOptions, group_advantages, surrogate_loss

# Two groups of three completions; rewards with ties, and a group whose rewards all agree.
REWARDS = [1.0, 0.0, 0.5, 2.0, 2.0, 2.0]
# Per-token log-probabilities of three completions of 3, 1 and 2 tokens (0 past their ends).
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)
LOGPS = torch.tensor([[-0.5, -1.0, -2.0], [-0.9, 0.0, 0.0], [-3.0, -0.2, 0.0]], dtype=torch.float64)
OLD = torch.tensor([[-0.8, -1.0, -1.0], [-0.6, 0.0, 0.0], [-2.5, -0.3, 0.0]], dtype=torch.float64)
REFERENCE = torch.tensor(
    [[-0.4, -1.5, -2.0], [-0.3, 0.0, 0.0], [-2.0, -0.2, 0.0]], dtype=torch.float64
)
ADVANTAGES = torch.tensor([1.5, -0.7, 0.4], dtype=torch.float64)
EPSILON, EPSILON_HIGH, BETA, MAX_LENGTH = 0.2, 0.28, 0.05, 4


def test_advantages_are_the_rewards_normalised_within_each_group():
    advantages, stds = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), group=3)
    for g in range(2):
        group = REWARDS[3 * g : 3 * g + 3]
        mean, std = statistics.mean(group), statistics.stdev(group)
        for i, reward in enumerate(group):
            assert advantages[3 * g + i].item() == pytest.approx((reward - mean) / (std + 1e-4))
            assert stds[3 * g + i].item() == pytest.approx(std)
    unscaled, _ = group_advantages(torch.tensor(REWARDS), group=3, scale=False)
    assert unscaled.tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0, 0.0, 0.0])


def token_loss(i: int, t: int, beta: float) -> float:
    """Token t of completion i: the clipped surrogate and beta times k3, by the formula."""
    rho = math.exp(LOGPS[i, t].item() - OLD[i, t].item())
    a = ADVANTAGES[i].item()
    clipped = min(max(rho, 1 - EPSILON), 1 + EPSILON_HIGH)
    d = REFERENCE[i, t].item() - LOGPS[i, t].item()
    return -min(rho * a, clipped * a) + beta * (math.exp(d) - d - 1)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, BETA])
def test_each_loss_type_aggregates_the_clipped_surrogate_as_trl_does(loss_type, beta):
    options = SurrogateOptions(EPSILON, EPSILON_HIGH, beta, loss_type, MAX_LENGTH)
    reference = REFERENCE if beta else None
    loss, units, sums = surrogate_loss(LOGPS, OLD, reference, ADVANTAGES, MASK, options)
    tokens = [[t for t in range(3) if MASK[i, t]] for i in range(3)]
    per_completion = [sum(token_loss(i, t, beta) for t in tokens[i]) for i in range(3)]
    every_token = sum(len(ts) for ts in tokens)
    if loss_type == "grpo":  # the mean over completions of each one's token mean
        expected = statistics.mean(
            s / len(ts) for s, ts in zip(per_completion, tokens, strict=True)
        )
    elif loss_type == "dr_grpo":  # over completions x max_completion_length
        expected = sum(per_completion) / (3 * MAX_LENGTH)
    else:  # dapo: over every completion token
        expected = sum(per_completion) / every_token
    assert (loss / units).item() == pytest.approx(expected, abs=1e-12)
    assert units.item() == (every_token if loss_type == "dapo" else 3)
    if beta:
        kl = [math.exp(d) - d - 1 for i in range(3) for t in tokens[i]
              for d in [REFERENCE[i, t].item() - LOGPS[i, t].item()]]  # fmt: skip
        assert sums["kl"].item() == pytest.approx(sum(kl))
    else:
        assert "kl" not in sums


def test_tokens_whose_ratio_left_the_trust_region_on_the_advantages_side_are_clipped():
    """Counted, and they pass no gradient: the policy is not pushed further that way."""
    logps = LOGPS.clone().requires_grad_(True)
    options = SurrogateOptions(EPSILON, EPSILON_HIGH, 0.0, "dapo", MAX_LENGTH)
    loss, _, sums = surrogate_loss(logps, OLD, None, ADVANTAGES, MASK, options)
    loss.backward()
    rho = torch.exp(LOGPS - OLD)
    a = ADVANTAGES[:, None]
    clipped = MASK & (((rho > 1 + EPSILON_HIGH) & (a > 0)) | ((rho < 1 - EPSILON) & (a < 0)))
    assert clipped.sum() == sums["clipped_tokens"] == 2  # one on either side
    assert (logps.grad[clipped] == 0).all()
    assert (logps.grad[MASK & ~clipped] != 0).all()
    assert (logps.grad[~MASK] == 0).all()


def test_on_policy_the_ratio_is_one_and_the_gradient_is_the_advantage_weighted_score():
    """With old = logp (one update per rollout), d loss / d logp_t = -A / (normaliser)."""
    logps = LOGPS.clone().requires_grad_(True)
    options = SurrogateOptions(EPSILON, None, 0.0, "dapo", MAX_LENGTH)
    loss, _, sums = surrogate_loss(logps, logps.detach(), None, ADVANTAGES, MASK, options)
    loss.backward()
    assert sums["clipped_tokens"] == 0
    expected = torch.where(MASK, -ADVANTAGES[:, None].expand_as(LOGPS), 0.0)
    torch.testing.assert_close(logps.grad, expected)
