"""GRPO's reward functions (src/models/language/grpo/rewards.py): TRL's calling convention, the
weighted sum with unscored completions left out, and one-line errors for a reward that cannot
be computed."""

import math

import pytest
import torch

from src.models.language.grpo.rewards import ExactMatch, RegexFormat, Rewards
from src.utils.errors import ConfigError, DataError


def score(rewards: Rewards, completions, **columns):
    prompts = ["p"] * len(completions)
    ids = [[0]] * len(completions)
    return rewards.score(prompts, completions, ids, columns)


def test_exact_match_compares_the_stripped_completion_with_the_answer_column():
    reward = ExactMatch()
    completions = [" 7", "7\n", "17", "seven", [{"role": "assistant", "content": "7 "}]]
    assert reward(completions, answer=["7", "7", "7", "7", "7"]) == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert ExactMatch(column="label")(["a"], label=["a"]) == [1.0]


def test_exact_match_names_the_column_it_lacks_and_the_columns_there_are():
    with pytest.raises(DataError, match=r"column 'answer'.*\['solution'\]"):
        ExactMatch()(["7"], solution=["7"], prompts=["p"], completion_ids=[[1]])


def test_regex_format_matches_the_whole_completion():
    reward = RegexFormat(r"<think>.*?</think>\s*\d+")
    completions = ["<think>3+4</think> 7", "<think>\n3\n</think>7", "7", "<think>x</think> 7 ok"]
    assert reward(completions) == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ConfigError, match=r"pattern '\(' is no regex"):
        RegexFormat("(")


def test_rewards_are_weighed_and_summed_and_unscored_completions_add_nothing():
    def length_or_none(completions, **columns):
        return [None if c == "skip" else float(len(c)) for c in completions]

    rewards = Rewards(
        {
            "exact": {"function": ExactMatch(), "weight": 1.0},
            "length": {"function": length_or_none, "weight": 0.5},
        }
    )
    total, each = score(rewards, ["7", "skip", "12"], answer=["7", "skip", "3"])
    assert total.tolist() == [1.5, 1.0, 1.0]
    assert each["exact"].tolist() == [1.0, 1.0, 0.0]
    assert each["length"][0] == 1.0
    assert math.isnan(each["length"][1])
    assert rewards.names == ["exact", "length"]


def test_a_reward_giving_the_wrong_number_of_scores_is_named():
    rewards = Rewards({"short": {"function": lambda completions, **_: [1.0]}})
    with pytest.raises(DataError, match=r"reward.short returned 1 scores for 2 completions"):
        score(rewards, ["a", "b"])


def test_no_reward_or_one_that_is_not_callable_is_refused():
    with pytest.raises(ConfigError, match=r"reward.bad.function must be a callable"):
        Rewards({"bad": {"function": "src.module.function"}})
    with pytest.raises(ConfigError, match=r"needs at least one reward function"):
        Rewards({}).check_some()


def test_rewards_receive_trl_arguments_prompts_completions_ids_and_the_columns():
    seen = {}

    def spy(prompts, completions, completion_ids, answer, **rest):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, answer=answer)
        return [0.0] * len(completions)

    Rewards({"spy": {"function": spy}}).score(
        ["p1", "p2"], ["a", "b"], [[1], [2, 3]], {"answer": ["x", "y"]}
    )
    assert seen == {
        "prompts": ["p1", "p2"],
        "completions": ["a", "b"],
        "ids": [[1], [2, 3]],
        "answer": ["x", "y"],
    }
    assert torch.is_tensor(
        Rewards({"spy": {"function": spy}}).score(["p"], ["a"], [[1]], {"answer": ["x"]})[0]
    )
