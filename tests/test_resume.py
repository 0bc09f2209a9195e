"""A run killed at any step and resumed ends exactly where the uninterrupted run ends."""

import json
import random

import pytest
import torch

from tests.helpers import (
    FAST,
    assert_same_tensors,
    compose_config,
    run_train,
    shakespeare_excerpt,
    text_lm_overrides,
)
from train import train

# Two epochs of 20 steps, a checkpoint after every step, bitwise-deterministic kernels, and
# randomness everywhere it can hide: shuffling, dropout (CNN) and per-sample augmentation.
RUN = [
    *FAST,
    "model=cnn",
    "trainer.max_epochs=2",
    "trainer.deterministic=true",
    "callbacks.last_checkpoint.every_n_train_steps=1",
    "callbacks.last_checkpoint.every_n_epochs=null",
    "data.train_transform={_target_: torchvision.transforms.v2.RandomAffine, degrees: 10}",
]
STEPS = 2 * 20


def final_state(run_dir):
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    metrics = json.loads((run_dir / "metrics.json").read_text())["metrics"]
    logged = {k: v for k, v in metrics.items() if not k.startswith("perf/")}
    return checkpoint, logged


def killed_run(run: list[str], run_dir, kill_step: int):
    """`train.py <run>` in a subprocess SIGKILLed at the end of step `kill_step`; its last.ckpt."""
    killer = [
        "+callbacks.killer._target_=tests.helpers.KillAtStep",
        f"+callbacks.killer.step={kill_step}",
    ]
    killed = run_train([*run, *killer], run_dir, check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    return run_dir / "checkpoints" / "last.ckpt"


def assert_same_training_state(expected_checkpoint, checkpoint):
    assert_same_tensors(expected_checkpoint["state_dict"], checkpoint["state_dict"], "weights")
    assert_same_tensors(
        expected_checkpoint["optimizer_states"], checkpoint["optimizer_states"], "optimizer"
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    train(compose_config(run_dir, RUN))
    return final_state(run_dir)


@pytest.mark.parametrize("seed", [0, 1])
def test_sigkill_at_a_random_step_then_resume_matches_the_uninterrupted_run(
    tmp_path, uninterrupted, seed
):
    kill_step = random.Random(seed).randrange(3, STEPS - 2)  # mid-epoch for most seeds
    last = killed_run(RUN, tmp_path, kill_step)
    assert torch.load(last, weights_only=True)["global_step"] == kill_step - 1

    train(compose_config(tmp_path, [*RUN, f"ckpt_path={last}"]))
    expected_checkpoint, expected_metrics = uninterrupted
    checkpoint, metrics = final_state(tmp_path)
    assert checkpoint["global_step"] == expected_checkpoint["global_step"] == STEPS
    assert_same_training_state(expected_checkpoint, checkpoint)
    assert metrics == expected_metrics


@pytest.mark.slow
def test_a_packed_lm_run_killed_in_its_second_epoch_resumes_exactly(tmp_path):
    """Epoch-based, with a cosine schedule over the run's total steps: asking the Trainer for
    them before the restore would lose the data loader's position (Lightning #20550)."""
    run = [
        *FAST,
        *text_lm_overrides(shakespeare_excerpt(tmp_path, 6000)),
        "model=qwen3_next_tiny",
        "model.config.hidden_size=32",
        "model.config.intermediate_size=64",
        "model.config.head_dim=16",
        "model.config.linear_key_head_dim=8",
        "model.config.linear_value_head_dim=8",
        "scheduler.scheduler.warmup_steps=2",
        "data.max_seq_len=64",
        "data.batch_size=2",
        f"data.cache_dir={tmp_path / 'cache'}",
        "trainer.max_epochs=2",
        "trainer.deterministic=true",
        "callbacks.last_checkpoint.every_n_train_steps=1",
        "callbacks.last_checkpoint.every_n_epochs=null",
        "test=false",
    ]
    train(compose_config(tmp_path / "whole", run))
    expected_checkpoint, expected_metrics = final_state(tmp_path / "whole")
    steps = expected_checkpoint["global_step"]
    kill_step = steps // 2 + 3  # inside the second epoch
    last = killed_run(run, tmp_path / "killed", kill_step)
    train(compose_config(tmp_path / "killed", [*run, f"ckpt_path={last}"]))
    checkpoint, metrics = final_state(tmp_path / "killed")
    assert checkpoint["global_step"] == steps
    assert_same_training_state(expected_checkpoint, checkpoint)
    assert metrics == expected_metrics
