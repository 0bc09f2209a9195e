"""scripts/bench_moe.py in --quick mode: the report's format and its numerics check, never
its timings."""

import re

import pytest

from scripts.bench_moe import main as bench_main

HEADER = (
    "| precision | ours tok/s | transformers grouped_mm tok/s | transformers eager tok/s "
    "| speedup vs grouped_mm | speedup vs eager | cold start ours / grouped_mm / eager "
    "| first-step Δ loss vs grouped_mm / eager | numerics |"
)
SCALING_HEADER = (
    "| precision | implementation | experts | expert params | step | forward + backward | AdamW "
    "| step vs fewest experts | peak memory growth | experts' weights, grads, AdamW | the rest |"
)
COMPILED_HEADER = (
    "| precision | ours compiled tok/s | transformers grouped_mm compiled tok/s "
    "| speedup compiled vs compiled | ours compiled vs eager | compilation ours / transformers "
    "| first-step Δ loss vs ours eager / transformers compiled |"
)
MIB = r"-?[\d,]+ MiB"
QUICK_EXPERTS = (4, 16)  # --quick's --scaling-experts


def test_quick_moe_benchmark_compares_the_same_weights_and_scales_the_experts(tmp_path):
    output = tmp_path / "bench.md"
    argv = ["--quick", "--precisions", "fp32", "--no-memory", "--output", str(output)]
    results = bench_main(argv)

    (row,) = results["comparison"]
    assert row["precision"] == "fp32"
    for column in ("ours tok/s", "transformers grouped_mm tok/s", "transformers eager tok/s"):
        assert re.fullmatch(r"[\d,]+", row[column]), row
    assert re.fullmatch(r"\d+\.\d\dx", row["speedup vs grouped_mm"]), row
    assert re.fullmatch(r"([\d.]+ s / ){2}[\d.]+ s", row["cold start ours / grouped_mm / eager"])
    # Same config and weights: the first training step's losses agree, in fp32 to 1e-4.
    assert row["numerics"] == "ok (< 1e-04)", row
    deltas = [float(d) for d in row["first-step Δ loss vs grouped_mm / eager"].split(" / ")]
    assert max(deltas) < 1e-4, row

    scaling = results["scaling"]
    expected = [(name, e) for name in ("ours", "transformers grouped_mm") for e in QUICK_EXPERTS]
    assert sorted((r["implementation"], int(r["experts"])) for r in scaling) == sorted(expected)
    for r in scaling:
        assert re.fullmatch(r"[\d,]+ ms", r["step"]), r
        assert r["peak memory growth"] == "-", r
    stored = {r["experts"]: r["experts' weights, grads, AdamW"] for r in scaling}
    assert len(set(stored.values())) == len(QUICK_EXPERTS)  # grows with the experts

    report = output.read_text()
    assert report.startswith("Machine: ")
    assert re.search(r"^bf16 units: ", report, re.MULTILINE)
    assert "`python scripts/bench_moe.py --quick --precisions fp32 --no-memory" in report
    assert re.search(r"^fp32 matmul peak of this CPU \(256² torch.mm\): [\d,]+ GFLOP/s$", report,
                     re.MULTILINE)  # fmt: skip
    lines = report.splitlines()
    assert HEADER in lines
    assert SCALING_HEADER in lines
    assert len([line for line in lines if line.startswith("| ")]) == 2 + 1 + len(scaling)


@pytest.mark.slow  # a child process importing torch and transformers, forking per measurement
def test_peak_memory_grows_with_the_stored_experts():
    results = bench_main(["--quick", "--precisions", "fp32", "--scaling-experts", "4", "64"])
    for r in results["scaling"]:
        assert re.fullmatch(MIB, r["peak memory growth"]), r
        assert re.fullmatch(MIB, r["the rest"]), r
    growth = {(r["implementation"], r["experts"]): int(r["peak memory growth"].split()[0])
              for r in results["scaling"]}  # fmt: skip
    # 60 more experts of 3 x 64 x 32 in 2 layers, 16 bytes each: 11.25 MiB more at least.
    for name in ("ours", "transformers grouped_mm"):
        assert growth[name, "64"] - growth[name, "4"] >= 10, growth


@pytest.mark.slow
def test_compiled_models_train_the_same_first_step(tmp_path):
    # aot_eager traces what inductor would compile (fake tensors, AOT autograd) in seconds.
    output = tmp_path / "bench.md"
    argv = ["--quick", "--precisions", "fp32", "--scaling-experts", "--compile", "aot_eager"]
    (row,) = bench_main([*argv, "--output", str(output)])["comparison"]
    deltas = row["first-step Δ loss vs ours eager / transformers compiled"].split(" / ")
    assert max(float(d) for d in deltas) < 1e-4, row
    for column in ("ours compiled tok/s", "transformers grouped_mm compiled tok/s"):
        assert re.fullmatch(r"[\d,]+", row[column]), row
    assert re.fullmatch(r"[\d.]+ s / [\d.]+ s", row["compilation ours / transformers"]), row
    report = output.read_text()
    assert "The same rounds, under torch.compile (aot_eager)" in report
    assert COMPILED_HEADER in report.splitlines()


def test_a_top_k_above_an_expert_count_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench_main(["--top-k", "8", "--scaling-experts", "4"])
    assert "--top-k must be at least 1 and at most every expert count" in capsys.readouterr().err
