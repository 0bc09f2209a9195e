"""Preemption, numerical faults and checkpoint policies."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from src.callbacks.training.finite_check import NonFiniteError
from tests.helpers import FAST, ROOT, compose_config
from train import train


class PoisonAtStep(Callback):
    """Makes the loss NaN from step `step` on, by poisoning one weight."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.net.fc1.weight[0, 0] = float("nan")


def test_a_nan_loss_stops_the_run_naming_the_step_and_keeping_the_last_good_checkpoint(
    tmp_path,
):
    cfg = compose_config(
        tmp_path,
        [
            *FAST,
            "trainer.max_epochs=2",
            "callbacks.last_checkpoint.every_n_train_steps=5",
            "callbacks.last_checkpoint.every_n_epochs=null",
            "+callbacks.poison._target_=tests.callbacks.test_reliability.PoisonAtStep",
            "+callbacks.poison.step=12",
        ],
    )
    with pytest.raises(NonFiniteError, match="step 12") as error:
        train(cfg)
    assert "last.ckpt" in str(error.value)
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 10
    weights = {k: v for k, v in last["state_dict"].items() if k.startswith("net.")}
    assert all(torch.isfinite(v).all() for v in weights.values())


def training_process(args: list[str], run_dir) -> subprocess.Popen:
    """`python train.py <args> hydra.run.dir=<run_dir>` running, its output readable as text."""
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
def test_sigterm_saves_between_steps_and_exits_cleanly_then_ckpt_path_last_resumes(tmp_path):
    slow = [
        f"+callbacks.slow._target_={SlowSteps.__module__}.SlowSteps",
        "trainer.max_epochs=50",
    ]
    process = training_process([*FAST, *slow], tmp_path)
    deadline = time.time() + 120
    while not (tmp_path / "started").exists() and time.time() < deadline:
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output[-3000:]
    assert "SIGTERM received" in output
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["preempted"] is True
    stopped_at = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)[
        "global_step"
    ]
    assert 0 < stopped_at < 50 * 20

    resumed = train(
        compose_config(
            tmp_path, [*FAST, "ckpt_path=last", f"trainer.max_epochs={stopped_at // 20 + 2}"]
        )
    )
    final = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert final["global_step"] == (stopped_at // 20 + 2) * 20
    assert "test/acc" in resumed["metrics"]


class SlowSteps(Callback):
    """Marks the run as started after a few steps, then makes each step take a while."""

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 3:
            Path(trainer.default_root_dir, "started").touch()
        time.sleep(0.02)


def test_keep_last_n_periodic_checkpoints(tmp_path):
    train(
        compose_config(
            tmp_path,
            [
                *FAST,
                "trainer.max_epochs=1",
                "callbacks.last_checkpoint.every_n_train_steps=4",
                "callbacks.last_checkpoint.every_n_epochs=null",
                "callbacks.last_checkpoint.save_top_k=2",
            ],
        )
    )
    periodic = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*.ckpt"))
    assert periodic == ["step_00000016.ckpt", "step_00000020.ckpt"]
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()


class PoisonGradient(Callback):
    """An Inf gradient with a finite loss, as a sqrt(0) in backward would produce."""

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == 3:
            pl_module.net.fc2.bias.grad[0] = float("inf")


def test_a_non_finite_gradient_is_caught_before_the_step_naming_the_parameter(tmp_path):
    cfg = compose_config(
        tmp_path,
        [*FAST, "+callbacks.poison._target_=tests.callbacks.test_reliability.PoisonGradient"],
    )
    with pytest.raises(NonFiniteError, match=r"step 3.*gradient of net\.fc2\.bias"):
        train(cfg)


def test_the_time_limit_signal_saves_then_hands_over_to_the_launchers_handler(tmp_path):
    handed_over = []

    def launcher_handler(signum, frame):  # e.g. submitit's: requeue the job
        saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
        handed_over.append((signum, saved["global_step"]))

    previous = signal.signal(signal.SIGUSR2, launcher_handler)
    try:
        overrides = [
            *FAST,
            "trainer.max_epochs=3",
            "+callbacks.signal._target_=tests.helpers.SignalAtStep",
            "+callbacks.signal.step=5",
            "+callbacks.signal.name=SIGUSR2",
        ]
        record = train(compose_config(tmp_path, overrides))
        assert signal.getsignal(signal.SIGUSR2) is launcher_handler  # restored after training
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert handed_over == [(signal.SIGUSR2, 6)]  # saved after the step in progress
    assert record["preempted"] is True


def test_ctrl_c_saves_after_the_step_and_prints_a_command_that_resumes(tmp_path, caplog):
    overrides = [
        *FAST,
        "trainer.max_epochs=2",
        "+callbacks.signal._target_=tests.helpers.SignalAtStep",
        "+callbacks.signal.step=5",
        "+callbacks.signal.name=SIGINT",
    ]
    record = train(compose_config(tmp_path, overrides))
    assert record["preempted"] is True
    assert record["interrupted"] is True
    assert json.loads((tmp_path / "metrics.json").read_text())["interrupted"] is True
    assert (
        torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6
    )  # after the step in progress
    command = caplog.text.split("Resume with:\n")[1].splitlines()[0].strip()
    words = shlex.split(command)
    assert words[:2] == ["python", "train.py"], command
    assert f"hydra.run.dir={tmp_path}" in words, command
    assert "ckpt_path=last" in words, command

    resumed = [word for word in words[2:] if not word.startswith(("+callbacks.signal", "hydra."))]
    train(compose_config(tmp_path, resumed))
    final = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert final["global_step"] == 2 * 20, "the printed command did not finish the run"


class InterruptedThenWaits(Callback):
    """Presses Ctrl-C (SIGINT to its own process) at step 3, then waits for a second one."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 3:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(120)


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_without_saving(tmp_path):
    waits = ["+callbacks.wait._target_=tests.callbacks.test_reliability.InterruptedThenWaits"]
    process = training_process([*FAST, *waits], tmp_path)
    output = []
    for line in process.stdout:
        output.append(line)
        if "Ctrl-C again" in line:
            process.send_signal(signal.SIGINT)
            break
    output.append(process.communicate(timeout=60)[0])
    assert process.returncode == 1, "".join(output)[-3000:]
    assert not list(tmp_path.glob("checkpoints/*.ckpt")), "the second Ctrl-C still saved"
    assert not (tmp_path / "metrics.json").exists()
