"""scripts/bench_lm.py in --quick mode: the report's format, never its timings."""

import re

import pytest
import torch

from scripts.bench_lm import main as bench_main

HEADER = (
    "| model | precision | params | ours tok/s | transformers tok/s | speedup | ours MFU "
    "| transformers MFU | cold start ours / transformers | max abs Δ logits |"
)


def test_quick_benchmark_reports_every_model_and_precision_in_a_markdown_table(tmp_path):
    output = tmp_path / "bench.md"
    rows = bench_main(["--quick", "--output", str(output)])

    assert [(row["model"].split()[0], row["precision"]) for row in rows] == [
        ("dense", "fp32"),
        ("dense", "bf16-mixed"),
        ("hybrid", "fp32"),
        ("hybrid", "bf16-mixed"),
    ]
    for row in rows:
        assert re.fullmatch(r"[\d,]+", row["ours tok/s"]), row
        assert re.fullmatch(r"[\d,]+", row["transformers tok/s"]), row
        assert re.fullmatch(r"\d+\.\d\dx", row["speedup"]), row
        assert re.fullmatch(r"\d+\.\d%", row["ours MFU"]), row
        assert re.fullmatch(r"[\d.]+ s / [\d.]+ s", row["cold start ours / transformers"]), row
    # Numerics are checked before timing: identical weights give the same fp32 logits.
    assert all(float(row["max abs Δ logits"]) < 1e-5 for row in rows if row["precision"] == "fp32")

    report = output.read_text()
    assert report.startswith("Machine: ")
    assert "Device: cpu; MFU peak: " in report and "measured 512x512 matmul" in report
    assert "`python scripts/bench_lm.py --quick" in report
    assert HEADER in report.splitlines()
    assert len([line for line in report.splitlines() if line.startswith("| ")]) == 1 + len(rows)


def test_a_model_that_is_neither_a_short_name_nor_an_lm_config_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench_main(["--models", "dense", "qwen3_huge"])
    assert "'qwen3_huge' is neither of ['dense', 'hybrid'] nor a config" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="here --device cuda is valid")
def test_device_cuda_without_a_gpu_is_refused_rather_than_benchmarking_the_cpu(capsys):
    with pytest.raises(SystemExit):
        bench_main(["--device", "cuda"])
    assert "--device cuda: this machine has no CUDA device" in capsys.readouterr().err
