"""The preference losses (src/models/language/preference/losses.py) against their published
formulas, written out again here per pair in float64 Python arithmetic: DPO (Rafailov et al.
2023) with conservative label smoothing, IPO (Azar et al. 2023) on per-token log-ratios as TRL
takes them, hinge (SLiC), SimPO (Meng et al. 2024) and ORPO (Hong et al. 2024)."""

import math

import pytest
import torch

from src.models.language.preference.losses import Pair, PreferenceLoss
from src.utils.errors import ConfigError

BETA, SMOOTHING, GAMMA = 0.3, 0.1, 0.7
# Log-probabilities summed over each response, and the responses' lengths in tokens: pairs
# that the policy prefers, disprefers and ties, short and long, near 0 and far below it.
POLICY = Pair(torch.tensor([-12.5, -3.25, -40.0, -0.02]), torch.tensor([-15.0, -2.5, -38.5, -0.9]))
REFERENCE = Pair(
    torch.tensor([-13.0, -3.0, -41.0, -0.05]), torch.tensor([-14.0, -2.75, -38.0, -1.2])
)
LENGTHS = Pair(torch.tensor([5, 2, 17, 1]), torch.tensor([7, 2, 12, 3]))


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def published(loss_type: str, i: int) -> tuple[float, float, float]:
    """(loss, chosen reward, rejected reward) of pair `i` by the paper's formula."""
    pc, pr = float(POLICY.chosen[i]), float(POLICY.rejected[i])
    rc, rr = float(REFERENCE.chosen[i]), float(REFERENCE.rejected[i])
    nc, nr = int(LENGTHS.chosen[i]), int(LENGTHS.rejected[i])
    h = (pc - rc) - (pr - rr)
    rewards = (BETA * (pc - rc), BETA * (pr - rr))
    if loss_type == "sigmoid":
        loss = -(1 - SMOOTHING) * log_sigmoid(BETA * h) - SMOOTHING * log_sigmoid(-BETA * h)
    elif loss_type == "ipo":
        loss = ((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * BETA)) ** 2
    elif loss_type == "hinge":
        loss = max(0.0, 1 - BETA * h)
    elif loss_type == "simpo":
        logits = BETA * pc / nc - BETA * pr / nr - GAMMA
        loss = -(1 - SMOOTHING) * log_sigmoid(logits) - SMOOTHING * log_sigmoid(-logits)
        rewards = (BETA * pc / nc, BETA * pr / nr)
    else:  # orpo: odds(y) = P(y) / (1 - P(y)), P the per-token mean probability
        mc, mr = pc / nc, pr / nr
        odds_c, odds_r = math.exp(mc) / (1 - math.exp(mc)), math.exp(mr) / (1 - math.exp(mr))
        loss = -mc - BETA * log_sigmoid(math.log(odds_c / odds_r))
        rewards = (BETA * mc, BETA * mr)
    return loss, *rewards


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "simpo", "orpo"])
def test_each_loss_type_agrees_with_its_published_formula(loss_type):
    smoothing = SMOOTHING if loss_type in ("sigmoid", "simpo") else 0.0
    loss = PreferenceLoss(loss_type, beta=BETA, label_smoothing=smoothing, simpo_gamma=GAMMA)
    reference = REFERENCE if loss.needs_reference else None
    losses, rewards = loss(POLICY, reference, LENGTHS)
    for i in range(len(losses)):
        expected = published(loss_type, i)
        actual = (float(losses[i]), float(rewards.chosen[i]), float(rewards.rejected[i]))
        assert actual == pytest.approx(expected, abs=1e-6), f"{loss_type}, pair {i}"


def test_gradients_flow_to_the_policy_and_never_through_the_rewards():
    policy = Pair(POLICY.chosen.clone().requires_grad_(), POLICY.rejected.clone().requires_grad_())
    losses, rewards = PreferenceLoss()(policy, REFERENCE, LENGTHS)
    losses.sum().backward()
    assert policy.chosen.grad is not None
    assert (policy.chosen.grad < 0).all()
    assert not rewards.chosen.requires_grad


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"loss_type": "kto"}, "choose one of"),
        ({"beta": 0}, "beta=0"),
        ({"label_smoothing": 0.5}, r"in \[0, 0.5\)"),
        ({"loss_type": "ipo", "label_smoothing": 0.1}, "applies to the loss types"),
    ],
)
def test_options_that_name_no_loss_are_refused_naming_the_key(options, message):
    with pytest.raises(ConfigError, match=message):
        PreferenceLoss(**options)
