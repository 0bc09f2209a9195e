"""The data-mixture benchmark on tiny inputs: its report's rows and arithmetic, never timings."""

import re

from scripts.bench_mixture import main as bench_main


def test_quick_mixture_benchmark_reports_every_arm_against_its_one_source_reference(tmp_path):
    output = tmp_path / "bench.md"
    result = bench_main(["--quick", "--output", str(output)])

    (draw,) = result["draws"]
    assert draw["rows"] == "10,000"
    one, three = (
        float(draw[c].split()[0].replace(",", "")) for c in ("one source", "mixture of 3")
    )
    ratio = float(draw["ratio"][:-1])
    # The times are printed to 0.1 ms, the ratio from the unrounded ones.
    assert (three - 0.05) / (one + 0.05) - 0.005 <= ratio, draw
    assert one <= 0.05 or ratio <= (three + 0.05) / (one - 0.05) + 0.005, draw
    assert [(row["corpus"], row["source"]) for row in result["loaders"]] == [
        (corpus, source)
        for corpus in ("0.2 MB", "0.2 MB, streamed")
        for source in ("one", "mixture of 3")
    ]
    for row in result["loaders"]:
        assert re.fullmatch(r"[\d,]+", row["rows/s"]), row
    assert {row["ratio"] for row in result["loaders"][::2]} == {"1.00x"}
    assert output.read_text().startswith("## Data mixtures (`scripts/bench_mixture.py`)")
