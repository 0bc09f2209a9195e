"""DDP on CPU (2 processes over gloo): same result as one process, exact resume, safe launch."""

import os
import random
import signal
import subprocess
import sys

import pytest
import torch
from lightning.pytorch import Callback

from tests.helpers import FAST, ROOT, compose_config
from tests.test_resume import assert_same_tensors
from train import train

# SimpleNet has no dropout, so one process and two see the same computation.
COMMON = [*FAST, "model=simplenet", "trainer.max_epochs=2", "test=false"]


def run_ddp(run_dir, *overrides, check=True):
    process = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            *COMMON,
            "trainer=ddp_cpu",
            "data.batch_size=32",
            f"hydra.run.dir={run_dir}",
            *overrides,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
    )
    if check:
        assert process.returncode == 0, process.stderr[-3000:]
    return process


def final_weights(run_dir):
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("net.")}


def test_two_processes_match_one_with_the_same_global_batch(tmp_path):
    run_ddp(tmp_path / "ddp")
    train(compose_config(tmp_path / "single", [*COMMON, "data.batch_size=64"]))
    ddp, single = final_weights(tmp_path / "ddp"), final_weights(tmp_path / "single")
    for key in single:
        torch.testing.assert_close(ddp[key], single[key], rtol=1e-5, atol=1e-6, msg=key)
    assert len(list((tmp_path / "ddp").glob("metrics.json"))) == 1


def test_a_multirun_with_ddp_is_refused_with_the_way_out(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "-m",
            "trainer=ddp_cpu",
            "seed=1,2",
            f"hydra.sweep.dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
    )
    assert result.returncode != 0
    assert "cannot use trainer.strategy=ddp" in result.stderr and "Traceback" not in result.stderr


class KillGroupAtStep(Callback):
    """SIGKILLs every process of the DDP run (its process group) at the end of `step`."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            os.killpg(os.getpgid(0), signal.SIGKILL)


@pytest.mark.slow
def test_ddp_killed_mid_epoch_resumes_exactly(tmp_path):
    every_step = [
        "callbacks.last_checkpoint.every_n_train_steps=1",
        "callbacks.last_checkpoint.every_n_epochs=null",
        "trainer.deterministic=true",
    ]
    run_ddp(tmp_path / "uninterrupted", *every_step)
    kill_step = random.Random(3).randrange(3, 38)
    killer = [
        "+callbacks.killer._target_=tests.test_distributed.KillGroupAtStep",
        f"+callbacks.killer.step={kill_step}",
    ]
    killed = run_ddp(tmp_path / "resumed", *every_step, *killer, check=False)
    assert killed.returncode == -9
    last = tmp_path / "resumed" / "checkpoints" / "last.ckpt"
    run_ddp(tmp_path / "resumed", *every_step, f"ckpt_path={last}")
    assert_same_tensors(
        final_weights(tmp_path / "uninterrupted"), final_weights(tmp_path / "resumed"), "weights"
    )


@pytest.mark.slow
def test_torchrun_launches_the_same_ddp_run(tmp_path):
    torchrun = ROOT / ".venv" / "bin" / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun not found in .venv")
    result = subprocess.run(
        [
            str(torchrun),
            "--nproc_per_node=2",
            str(ROOT / "train.py"),
            *COMMON,
            "trainer=ddp_cpu",
            "data.batch_size=32",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "metrics.json").exists() and (
        tmp_path / "checkpoints" / "last.ckpt"
    ).exists()
