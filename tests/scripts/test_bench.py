"""scripts/bench.py in quick mode: the output's shape and content, not its timings."""

import json
import re

import pytest
import torch

from scripts.bench import main


@pytest.mark.slow
def test_bench_quick_writes_every_case_with_medians_ratios_and_cold_start(tmp_path):
    out = tmp_path / "bench.json"
    argv = ["--quick", "--cases", "trainer,data,compile", "--out", str(out)]
    main(argv)
    result = json.loads(out.read_text())
    assert result["machine"]["torch"] == torch.__version__
    assert result["command"] == " ".join(["python", "scripts/bench.py", *argv])
    cases = {row["case"]: row for row in result["results"]}
    assert set(cases) == {"trainer/simplenet", "trainer/cnn", "data/mnist-like", "compile/cnn"}
    for row in cases.values():
        assert set(row["medians"]) == {row["reference"], row["candidate"]}
        assert all(value > 0 for value in row["medians"].values())
        expected = row["medians"][row["candidate"]] / row["medians"][row["reference"]]
        assert abs(row["ratio"] - expected) < 1e-9
    cold_start = cases["compile/cnn"]["cold_start_s"]
    assert cold_start["compiled"] > cold_start["eager"], (
        f"compilation not in the first step: {cold_start}"
    )


@pytest.mark.slow
def test_bench_quick_ddp_reports_scaling_efficiency_and_strategy_overhead(tmp_path):
    out = tmp_path / "bench.json"
    main(["--quick", "--cases", "ddp", "--batch-size", "32", "--out", str(out)])
    (row,) = json.loads(out.read_text())["results"]
    assert row["case"] == "ddp/simplenet"
    assert row["threads_per_process"] == 1
    one, two, one_half = "1 process, batch 32", "2 processes x batch 16", "1 process, batch 16"
    assert (row["reference"], row["candidate"]) == (one, two)
    assert set(row["medians"]) == {one, two, one_half}
    assert all(value > 0 for value in row["medians"].values())
    assert row["scaling_efficiency"] == pytest.approx(
        row["medians"][two] / (2 * row["medians"][one])
    )
    overhead = row["ms_per_step"][two] - row["ms_per_step"][one_half]
    assert row["overhead_ms_per_step"] == pytest.approx(overhead)


@pytest.mark.skipif(torch.cuda.is_available(), reason="here the fsdp case runs for real")
def test_the_fsdp_case_checks_every_arms_config_before_it_asks_for_a_gpu(tmp_path):
    """Without CUDA the case stops at the GPU check, which comes after every arm's config has
    composed and type-checked: an arm that does not compose fails here with its config error."""
    with pytest.raises(SystemExit, match="The fsdp case needs a CUDA GPU"):
        main(["--quick", "--cases", "fsdp", "--out", str(tmp_path / "bench.json")])
    assert not (tmp_path / "bench.json").exists()


def test_bench_quick_startup_reports_both_ratios_against_the_import(tmp_path, capsys):
    """One round of the three fresh processes (seconds each): the rows, not the timings."""
    out = tmp_path / "bench.json"
    rows = main(["--quick", "--cases", "startup", "--out", str(out)])
    assert json.loads(out.read_text())["results"] == rows
    cases = {row["case"]: row for row in rows}
    assert set(cases) == {"startup/--help", "startup/digits"}
    for row, candidate in [
        (cases["startup/--help"], "train.py --help"),
        (cases["startup/digits"], "digits, 1 epoch"),
    ]:
        assert (row["reference"], row["candidate"]) == ("import lightning", candidate)
        assert row["unit"] == "s"
        assert set(row["medians"]) == set(row["cold_start_s"]) == {"import lightning", candidate}
        assert row["ratio"] == pytest.approx(
            row["medians"][candidate] / row["medians"]["import lightning"]
        )
    table = capsys.readouterr().out
    for case, candidate in [("startup/--help", "train.py --help"), ("startup/digits", "digits")]:
        assert re.search(rf"^{case} +import lightning +[\d.]+ s ", table, re.MULTILINE), table
        assert re.search(rf"^ +{candidate}.* s +[\d.]+x$", table, re.MULTILINE), table
