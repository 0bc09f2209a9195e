"""scripts/bench.py in quick mode: the output's shape and content, not its timings."""

import json

import pytest

from scripts.bench import FSDP_ARMS, lm_overrides, main, train_process
from src.run.config_checks import check_config_types
from tests.helpers import compose_config


def test_bench_quick_writes_every_case_with_medians_ratios_and_cold_start(tmp_path):
    out = tmp_path / "bench.json"
    main(["--quick", "--cases", "trainer,data,compile", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["machine"]["torch"] and result["command"].startswith("python scripts/bench.py")
    cases = {row["case"]: row for row in result["results"]}
    assert set(cases) == {"trainer/simplenet", "trainer/cnn", "data/mnist-like", "compile/cnn"}
    for row in cases.values():
        assert set(row["medians"]) == {row["reference"], row["candidate"]}
        assert all(value > 0 for value in row["medians"].values())
        expected = row["medians"][row["candidate"]] / row["medians"][row["reference"]]
        assert abs(row["ratio"] - expected) < 1e-9
    assert cases["compile/cnn"]["cold_start_s"]["compiled"] > 0


@pytest.mark.slow
def test_bench_quick_ddp_reports_scaling_efficiency_and_strategy_overhead(tmp_path):
    out = tmp_path / "bench.json"
    main(["--quick", "--cases", "ddp", "--batch-size", "32", "--out", str(out)])
    (row,) = json.loads(out.read_text())["results"]
    assert row["case"] == "ddp/simplenet" and row["threads_per_process"] == 1
    one, two, one_half = "1 process, batch 32", "2 processes x batch 16", "1 process, batch 16"
    assert (row["reference"], row["candidate"]) == (one, two)
    assert set(row["medians"]) == {one, two, one_half}
    assert all(value > 0 for value in row["medians"].values())
    assert row["scaling_efficiency"] == pytest.approx(
        row["medians"][two] / (2 * row["medians"][one])
    )
    overhead = row["ms_per_step"][two] - row["ms_per_step"][one_half]
    assert row["overhead_ms_per_step"] == pytest.approx(overhead)


def test_every_fsdp_case_arm_composes_and_the_lm_run_reports_tokens_per_second(tmp_path):
    # The case itself needs a CUDA GPU; its runs' configs and the metrics it reads do not.
    for strategy in FSDP_ARMS.values():
        check_config_types(
            compose_config(tmp_path, [*lm_overrides("qwen3_0_6b", 8, 2048, 10, 30), *strategy])
        )
    cpu_run = [*lm_overrides("qwen3_tiny", 2, 64, 1, 2), "trainer=cpu", "trainer.precision=32-true"]
    metrics = train_process(cpu_run, tmp_path / "run")
    assert metrics["perf/tokens_per_s"] > 0 and metrics["perf/time_to_first_step_s"] > 0
    assert not (tmp_path / "run" / "checkpoints").exists()
