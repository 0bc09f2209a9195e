"""The profiler callback's files, and the bottleneck report's figures and verdicts."""

import json

import pytest

from src.callbacks.measurement.profile_report import analyse_trace, classify
from tests.helpers import FAST, compose_config
from train import train


def test_profile_short_writes_trace_operator_table_and_report(tmp_path):
    train(compose_config(tmp_path, ["+profile=short", *FAST]))
    profile_dir = tmp_path / "profile"
    trace = json.loads((profile_dir / "trace_rank0_cycle0.json").read_text())
    steps = [e for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")]
    assert len(steps) == 3  # skip 1, warm up 1, record 3
    assert any(e.get("args", {}).get("Input Dims") for e in trace["traceEvents"])  # shapes
    assert "Self CPU" in (profile_dir / "ops_rank0_cycle0.txt").read_text()
    report = (profile_dir / "report.md").read_text()
    verdict = json.loads((profile_dir / "report.json").read_text())["verdict"]
    assert verdict["category"] in report
    assert "carries overhead" in report
    assert (profile_dir / "report.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_profile_long_records_two_cycles_and_the_data_loader(tmp_path):
    train(compose_config(tmp_path, ["+profile=long", *FAST, "trainer.max_epochs=3"]))
    profile_dir = tmp_path / "profile"
    assert (profile_dir / "trace_rank0_cycle1.json").exists()
    data_trace = json.loads((profile_dir / "data_trace_rank0.json").read_text())
    names = {e.get("name", "") for e in data_trace["traceEvents"]}
    assert any(name.startswith("enumerate(DataLoader)") for name in names)


def event(name, ts, dur, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}


def test_window_figures_match_a_hand_built_trace(tmp_path):
    events = []
    for step, start in enumerate((0, 1000)):
        events += [
            event(f"ProfilerStep#{step}", start, 1000, cat="user_annotation"),
            event(
                "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
                start,
                200,
                cat="user_annotation",
            ),
            event("aten::stack", start + 50, 100),  # inside data loading: not model time
            event("aten::linear", start + 300, 400),
            event("aten::addmm", start + 310, 300),  # child: linear's self time is 100
            event("aten::relu", start + 800, 100),
        ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    stats = analyse_trace(path)
    assert stats.steps == 2
    assert stats.window_us == 2000
    assert stats.data_wait_fraction == pytest.approx(0.2)
    assert stats.ops_per_step == 3
    assert stats.mean_op_us == pytest.approx(500 / 3)  # self times 100 + 300 + 100
    assert stats.matmul_fraction == pytest.approx(0.6)
    assert stats.elementwise_fraction == pytest.approx(0.2)
    # busy: data 200 + linear 400 + relu 100 per 1000 µs step
    assert stats.idle_fraction == pytest.approx(0.3)


def step_trace(tmp_path, ops_per_step: list[tuple[str, int]], data_us: int = 0):
    """A hand-built trace of two 1000 µs steps, each waiting `data_us` for data and then running
    `ops_per_step` (name, duration in µs) back to back."""
    events = []
    for step, start in enumerate((0, 1000)):
        events.append(event(f"ProfilerStep#{step}", start, 1000, cat="user_annotation"))
        if data_us:
            name = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"
            events.append(event(name, start, data_us, cat="user_annotation"))
        now = start + data_us
        for name, duration in ops_per_step:
            events.append(event(name, now, duration))
            now += duration
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return analyse_trace(path)


# Each bottleneck as the profiler records it, with durations fixed, so that the verdict does
# not depend on how fast this machine runs a workload.
WINDOWS = {
    "dispatch_overhead": ([("aten::mul", 2), ("aten::add", 2)] * 50, 0),  # 200 µs busy
    "compute_bound": ([("aten::mm", 800), ("aten::relu", 100)], 0),
    "memory_bandwidth": ([("aten::mul", 500), ("aten::copy_", 300), ("aten::mm", 100)], 0),
    "input_or_communication": ([("aten::linear", 100)], 600),
}


@pytest.mark.parametrize("expected", list(WINDOWS))
def test_each_kind_of_window_gets_its_verdict(tmp_path, expected):
    ops, data_us = WINDOWS[expected]
    stats = step_trace(tmp_path, ops, data_us)
    verdict = classify(stats)
    assert verdict.category == expected, (verdict, stats)
