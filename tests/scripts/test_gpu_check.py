"""scripts/gpu_check.sh: refuses what it cannot run, and its CPU dry run runs every other step."""

import json
import os
import sys

import pytest
import torch

from tests.helpers import run_script


def gpu_check(tmp_path, **env):
    """`bash scripts/gpu_check.sh` with `env` added, writing into tmp_path."""
    variables = {**os.environ, "PY": sys.executable, "OUT_DIR": str(tmp_path / "check"), **env}
    return run_script("scripts/gpu_check.sh", check=False, launcher=["bash"], env=variables,
                      timeout=1200)  # fmt: skip


def test_an_unknown_device_is_refused(tmp_path):
    result = gpu_check(tmp_path, DEV="tpu")
    assert result.returncode == 2
    assert "DEV must be cuda or cpu, not 'tpu'" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="here the CUDA run is real")
def test_without_cuda_it_points_to_the_dry_run_instead_of_checking_the_cpu(tmp_path):
    result = gpu_check(tmp_path)
    assert result.returncode == 2, result.stdout[-2000:]
    assert "No CUDA device here: run DEV=cpu bash scripts/gpu_check.sh" in result.stderr
    assert not (tmp_path / "check" / "summary.md").exists()


@pytest.mark.slow
def test_the_cpu_dry_run_runs_every_step_but_the_cuda_only_ones(tmp_path):
    result = gpu_check(tmp_path, DEV="cpu", STEPS="4")
    out = tmp_path / "check"
    assert result.returncode == 0, result.stdout[-4000:]
    steps = dict(line.split("\t")[:2] for line in (out / "steps.tsv").read_text().splitlines())
    assert steps == {
        "facts": "ok",
        "parity": "ok",
        "fsdp": "skipped (Lightning runs FSDP on CUDA only)",
        "model_parallel": "ok",
        "sft_qwen3_5": "ok",
        "moe": "ok",
        "bench_lm": "ok",
        "bench_vocab": "ok",
        "bench_finetune": "ok",
    }
    summary = (out / "summary.md").read_text()
    assert "| model_parallel | ok |" in summary
    assert "perf/tokens_per_s" in summary
    assert "| model | precision | params |" in summary  # bench_lm's table is included
    assert "ours peak memory" in summary
    assert "| LoRA r=16 |" in summary
    assert "| QLoRA r=16 (NF4, bf16) |" in summary
    assert (out / "model_parallel" / "metrics.json").is_file()
    assert "| sft_qwen3_5 | ok |" in summary
    moe = json.loads((out / "moe" / "metrics.json").read_text())["metrics"]
    assert "moe/load_max_over_mean" in moe, sorted(moe)  # the experts routed and were logged
