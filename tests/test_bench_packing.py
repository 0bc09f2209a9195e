"""scripts/bench_packing.py in --quick mode: the report's format and accounting, never timings."""

import re

from scripts.bench_packing import COLUMNS
from scripts.bench_packing import main as bench_main


def test_quick_packing_benchmark_reports_both_arms_of_every_model(tmp_path):
    output = tmp_path / "bench.md"
    rows = bench_main(["--quick", "--datasets", "sft", "--output", str(output)])

    assert [(row["model"].split()[0], row["arm"]) for row in rows] == [
        (model, arm) for model in ("dense", "hybrid") for arm in ("packed", "padded", "bucketed")
    ]
    for row in rows:
        assert re.fullmatch(r"[\d,]+", row["real tok/s"]), row
        assert re.fullmatch(r"\d+\.\d%", row["padding"]), row
    packed, padded = rows[0], rows[1]
    assert float(packed["padding"][:-1]) < float(padded["padding"][:-1])
    assert re.fullmatch(r"≥ \d+\.\d\dx: (met|missed)", packed["target"])

    report = output.read_text()
    assert report.startswith("Machine: ")
    assert "| " + " | ".join(COLUMNS) + " |" in report
    assert re.search(r"sft: bytes [\d.]+ s with an empty cache, [\d.]+ s from it; BPE", report)
