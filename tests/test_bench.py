"""scripts/bench.py in quick mode: the output's shape and content, not its timings."""

import json

import pytest

from scripts.bench import main


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
