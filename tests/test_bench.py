"""scripts/bench.py in quick mode: the output's shape and content, not its timings."""

import json

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
