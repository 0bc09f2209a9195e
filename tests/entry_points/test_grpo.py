"""`python train.py experiment=lm_grpo`: GRPO from the command line samples groups of
completions, logs the reward metrics under train/, val/ and test/, holds its KL reference as the
adapter says (a frozen copy in checkpoints, or the base under LoRA), takes a user's own reward
function, and a run killed mid-training resumes exactly, its rollouts included."""

import pytest

from eval import evaluate
from tests.helpers import (
    FOUR_LM_STEPS,
    RESUMABLE_EVERY_STEP,
    assert_resumes_exactly,
    compose_config,
    trained_state,
)
from tests.models.support import save_tiny_base

STEP_METRICS = (
    "loss",
    "reward_mean",
    "reward_std",
    "rewards/exact_match/mean",
    "completions/mean_length",
    "completions/clipped_ratio",
    "frac_reward_zero_std",
    "clip_ratio/region_mean",
)
EVAL_METRICS = ("reward_mean", "rewards/exact_match/mean", "completions/mean_length")


def grpo_run(tmp_path, *extra: str) -> list[str]:
    """A few GRPO steps on a small synthetic prompt set, with a tiny model."""
    return [
        "experiment=lm_grpo",
        "data.synthetic_count=120",
        "data.batch_size=4",
        "model.grpo.num_generations=4",
        "model.grpo.max_completion_length=3",
        f"data.cache_dir={tmp_path / 'cache'}",
        *FOUR_LM_STEPS,
        *extra,
    ]


def completion_length(completions, **columns):
    """A user's own reward, by TRL's convention: here, each completion's length in characters."""
    return [float(len(completion)) for completion in completions]


@pytest.fixture(scope="module")
def frozen_reference_run(tmp_path_factory):
    """GRPO with a KL to a frozen copy and two rewards: its run folder and final state."""
    run_dir = tmp_path_factory.mktemp("grpo")
    options = [
        "reward=[exact_match,regex_format]",
        "reward.regex_format.function.pattern='[0-9]+'",
        "model.grpo.beta=0.04",
    ]
    return run_dir, trained_state(grpo_run(run_dir, *options), run_dir)


def test_lm_grpo_trains_and_logs_its_reward_metrics_under_train_val_and_test(frozen_reference_run):
    _, (checkpoint, metrics) = frozen_reference_run
    expected = [f"train/{m}" for m in (*STEP_METRICS, "kl", "rewards/regex_format/mean")]
    expected += [f"{stage}/{m}" for stage in ("val", "test") for m in EVAL_METRICS]
    missing = [key for key in expected if key not in metrics]
    assert not missing, f"{missing} not in {sorted(metrics)}"
    assert 0 <= metrics["val/reward_mean"] <= 1, "greedy answers scored by exact_match alone"
    assert metrics["train/kl"] >= 0
    assert metrics["train/reward_mean"] == pytest.approx(
        metrics["train/rewards/exact_match/mean"]
        + 0.2 * metrics["train/rewards/regex_format/mean"],
        rel=1e-5,
    )
    assert 1 <= metrics["train/completions/mean_length"] <= 3
    assert [k for k in checkpoint["state_dict"] if k.startswith("objective.reference.net.")]
    assert checkpoint["state_dict"]["objective._extra_state"] is not None, "no rollout RNG state"


def test_a_grpo_checkpoint_evaluates_as_its_run_tested(frozen_reference_run):
    tmp_path, _ = frozen_reference_run
    last = tmp_path / "checkpoints" / "last.ckpt"
    evaluated = evaluate(compose_config(tmp_path / "eval", [f"ckpt_path={last}"], "eval"))
    assert 0 <= evaluated["metrics"]["test/reward_mean"] <= 1


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_a_lora_run_takes_its_kl_against_the_base_and_a_users_own_reward(tmp_path, loss_type):
    base = save_tiny_base(tmp_path / "base")
    run = grpo_run(
        tmp_path,
        "adapter=lora",
        f"model.pretrained={base}",
        "model.grpo.beta=0.1",
        f"model.grpo.loss_type={loss_type}",
        f"+reward.length.function._target_={__name__}.completion_length",
        "+reward.length.function._partial_=true",
        "+reward.length.weight=0.01",
        "test=false",
    )
    checkpoint, metrics = trained_state(run, tmp_path)
    assert not [k for k in checkpoint["state_dict"] if k.startswith("objective.reference.net.")]
    assert metrics["train/kl"] >= 0
    length = metrics["train/rewards/length/mean"]
    assert 1 <= length <= 3 * 4, "a completion of 1 to 3 tokens has 1 to 12 UTF-8 characters"
    assert metrics["train/reward_mean"] == pytest.approx(
        metrics["train/rewards/exact_match/mean"] + 0.01 * length, rel=1e-5
    )


@pytest.mark.slow
def test_a_grpo_run_killed_mid_training_resumes_exactly(tmp_path):
    """As tests/checkpoints/test_resume.py: the rollouts after the resume are those the
    uninterrupted run sampled, so weights, optimizer and metrics end bitwise equal."""
    run = grpo_run(
        tmp_path,
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        *RESUMABLE_EVERY_STEP,
    )
    checkpoint = assert_resumes_exactly(run, tmp_path, kill_step=5)
    assert checkpoint["global_step"] == 6
