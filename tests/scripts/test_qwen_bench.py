"""scripts/bench_lm.py in --quick mode: the report's format, never its timings. `--memory` is
checked on scripts/gpu_check.sh's dry run (tests/scripts/test_gpu_check.py), which runs it."""

import re

import pytest
import torch

from scripts.bench_lm import main as bench_main

HEADER = (
    "| model | precision | params | ours tok/s | transformers tok/s | speedup | ours MFU "
    "| transformers MFU | cold start ours / transformers | max abs Δ logits | rel Δ loss |"
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
    # Numerics are checked before timing: identical weights give the same fp32 logits, and the
    # chunked loss is transformers' full-logits loss.
    for row in rows:
        if row["precision"] == "fp32":
            assert float(row["max abs Δ logits"]) < 1e-5, row
            assert float(row["rel Δ loss"]) < 1e-6, row

    report = output.read_text()
    assert report.startswith("Machine: ")
    assert "Device: cpu; MFU peak: " in report
    assert "measured 512x512 matmul" in report
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


@pytest.mark.slow
def test_finetune_compares_full_training_with_lora_with_and_without_recomputation():
    """Ours, and transformers' LoRA; QLoRA's rows run in scripts/gpu_check.sh's dry run
    (tests/scripts/test_gpu_check.py)."""
    argv = ["--quick", "--finetune", "--models", "dense", "--precisions", "fp32"]
    rows = bench_main([*argv, "--variants", "full", "lora"])
    assert [row["variant"] for row in rows] == [
        "full",
        "full, activation checkpointing",
        "LoRA r=16",
        "LoRA r=16, activation checkpointing",
    ]
    trainable = {row["variant"]: float(row["trainable params"][:-1]) for row in rows}
    assert trainable["LoRA r=16"] < trainable["full"]
    assert trainable["full, activation checkpointing"] == trainable["full"]
    assert trainable["LoRA r=16, activation checkpointing"] == trainable["LoRA r=16"]
    for row in rows:
        assert re.fullmatch(r"\d+\.\d\d GiB", row["peak memory"]), row
        assert re.fullmatch(r"\d+\.\d\d s", row["step"]), row
        # QLoRA's fewer bytes are tests/models/test_qlora.py's: --quick's projections are too
        # small for NF4's blocks and stay in bf16.
        assert re.fullmatch(r"[\d,]+ MiB \(\d+\.\d\d B/param\)", row["parameter bytes"]), row
    # transformers' model with peft's LoRA on the same projections trains as many weights.
    theirs = bench_main([*argv, "--variants", "lora", "--implementations", "transformers"])
    assert [(row["implementation"], row["variant"]) for row in theirs] == [
        ("transformers", "LoRA r=16"),
        ("transformers", "LoRA r=16, activation checkpointing"),
    ]
    assert {row["trainable params"] for row in theirs} == {f"{trainable['LoRA r=16']:.2f}M"}
    assert {row["implementation"] for row in rows} == {"ours"}
