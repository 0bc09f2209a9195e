"""`model.grpo`'s options: a mistaken one is refused in one line naming it and the fix."""

import pytest

from src.models.language.adapters import NoAdapter
from src.models.language.grpo.objective import GRPOObjective
from src.models.language.grpo.rewards import ExactMatch
from src.models.language.qwen import QwenLM
from src.utils.errors import ConfigError
from tests.helpers import tiny_config

REWARDS = {"exact_match": {"function": ExactMatch(), "weight": 1.0}}


def build(**options) -> GRPOObjective:
    net = QwenLM(tiny_config("qwen3"))
    return GRPOObjective.build({"rewards": REWARDS, **options}, net, NoAdapter(net))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_generation": 4}, r"model.grpo.num_generation is no GRPO option: did you mean "
                                r"num_generations\? they are beta, epsilon, "),
        ({"num_generations": 1}, r"num_generations=1: .* at least 2 per prompt"),
        ({"loss_type": "ppo"}, r"loss_type='ppo': choose one of grpo, dr_grpo, dapo"),
        ({"max_completion_length": 0}, r"max_completion_length=0: give the most tokens"),
        ({"epsilon": 0.0}, r"epsilon must be positive and beta 0 or more; got epsilon=0.0"),
        ({"beta": -0.1}, r"beta=-0.1"),
    ],
    ids=["misspelt", "one completion", "unknown loss", "no tokens", "no clip", "negative beta"],
)  # fmt: skip
def test_a_mistaken_option_is_refused_naming_it(options, message):
    with pytest.raises(ConfigError, match=message) as raised:
        build(**options)
    assert "\n" not in str(raised.value)


def test_the_kl_reference_is_a_frozen_copy_only_when_beta_asks_for_one():
    assert build(beta=0.0).reference is None
    reference = build(beta=0.1).reference
    assert reference is not None
    assert not any(p.requires_grad for p in reference.parameters())
