"""scripts/gpu_check.sh: refuses what it cannot run, and its CPU dry run runs every other step.
scripts/bench_lm.py --memory is checked here too, on the dry run's bench_vocab step."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from benchmarks import model_config

from src.models.language.qwen import QwenConfig, QwenLM
from tests.helpers import run_script


def gpu_check(tmp_path, **env):
    """`bash scripts/gpu_check.sh` with `env` added, writing into tmp_path."""
    variables = {**os.environ, "PY": sys.executable, "OUT_DIR": str(tmp_path / "check"), **env}
    return run_script("scripts/gpu_check.sh", check=False, launcher=["bash"], env=variables,
                      timeout=1200)  # fmt: skip


def table_row(report: Path) -> dict[str, str]:
    """The one row of the Markdown table in the file `report`, by column."""
    header, row = (
        line.strip(" |").split(" | ")
        for line in report.read_text().splitlines()
        if line.startswith("| ")
    )
    return dict(zip(header, row, strict=True))


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
    assert "| QLoRA r=16 (NF4, bf16) |" in summary
    assert (out / "model_parallel" / "metrics.json").is_file()
    assert "| sft_qwen3_5 | ok |" in summary
    moe = json.loads((out / "moe" / "metrics.json").read_text())["metrics"]
    assert "moe/load_max_over_mean" in moe, sorted(moe)  # the experts routed and were logged

    # bench_vocab: scripts/bench_lm.py --memory adds each implementation's peak, measured in a
    # process of its own, on the config that --vocab-size and --layers resized.
    row = table_row(out / "bench_vocab.md")
    ours, theirs = (
        float(row[f"{name} peak memory"].split()[0]) for name in ("ours", "transformers")
    )
    assert 0.1 < ours < 64, row
    assert 0.1 < theirs < 64, row
    assert float(row["memory ratio"][:-1]) == pytest.approx(ours / theirs, abs=0.02)
    resizing = {"vocab_size": 4096, "num_hidden_layers": 1, "layer_types": None}
    config = QwenConfig.from_dict({**model_config("qwen3_tiny", quick=True).to_dict(), **resizing})
    assert row["params"] == f"{QwenLM(config).num_parameters() / 1e6:.2f}M"
