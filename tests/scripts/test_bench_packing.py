"""The packing and data benchmarks on tiny inputs: the reports' format and accounting, never
timings."""

import re

import pytest

from scripts.bench_data import main as bench_data_main
from scripts.bench_packing import main as bench_main

HEADER = (
    "| data | model | arm | docs/step | padding | real tok/s | slot tok/s "
    "| speedup (real tok/s) | target | first step |"
)


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
    packed_padding, padded_padding = (float(row["padding"][:-1]) / 100 for row in (packed, padded))
    assert packed_padding < padded_padding
    assert padded["speedup (real tok/s)"] == "1.00x"
    assert padded["target"] == ""
    # The target is 0.9 x the padded arm's slots per real token (padding printed to 0.1%, the
    # target to 0.01), and the verdict is the one the speedup implies.
    match = re.fullmatch(r"≥ (\d+\.\d\d)x: (met|missed)", packed["target"])
    assert match, packed["target"]
    threshold, verdict = float(match[1]), match[2]
    low, high = (0.9 / (1 - padded_padding - rounding) for rounding in (-5e-4, 5e-4))
    assert low - 0.005 <= threshold <= high + 0.005, (threshold, padded["padding"])
    speedup = float(packed["speedup (real tok/s)"][:-1])
    if abs(speedup - threshold) > 0.01:  # both printed to 0.01: a closer call cannot be read
        assert verdict == ("met" if speedup > threshold else "missed"), packed

    report = output.read_text()
    assert report.startswith("Machine: ")
    assert HEADER in report.splitlines()
    assert re.search(r"sft: bytes [\d.]+ s with an empty cache, [\d.]+ s from it; BPE", report)


@pytest.mark.slow  # three child processes, each importing torch and datasets
def test_the_data_benchmark_reports_every_figure_of_a_tiny_corpus(tmp_path):
    output = tmp_path / "bench.md"
    argv = ["--sizes", "0.2", "--tokenizers", "byte", "--steps", "1", "--output", str(output)]
    (row,) = bench_data_main(argv)
    assert row["size"] == "0.2 MB"
    assert row["tokenizer"] == "byte"
    for column in ("prepare s", "MB/s", "anchor s", "loader tok/s", "train tok/s"):
        assert re.fullmatch(r"[\d,]+(\.\d+)?", row[column]), (column, row)
    for column in ("prepare RSS", "anchor RSS", "train RSS"):
        assert re.fullmatch(r"\d+ MB \(\+-?\d+\)( / \d+ MB)?", row[column]), (column, row)
    for column in ("prepare anon", "train anon"):
        assert re.fullmatch(r"\+-?\d+ MB", row[column]), (column, row)
    for column in ("2nd run: setup", "first step"):
        assert re.fullmatch(r"\d+\.\d\d s", row[column]), (column, row)
    assert "| size | tokenizer | prepare s |" in output.read_text()


@pytest.mark.slow  # a child process importing torch and datasets
def test_the_data_benchmark_measures_streaming_from_parquet_shards(tmp_path):
    (row,) = bench_data_main(["--streaming", "--sizes", "0.2", "--output", str(tmp_path / "b")])
    assert row["size"] == "0.2 MB"
    assert row["shards"] == "8"
    assert re.fullmatch(r"\d+\.\d\d s", row["first batch"]), row
    assert re.fullmatch(r"[\d,]+", row["loader tok/s"]), row
    assert row["loader tok/s"] != "0", row
    assert re.fullmatch(r"\d+ MB \(\+-?\d+\)( / \d+ MB)?", row["RSS"]), row
