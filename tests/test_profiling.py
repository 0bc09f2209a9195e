"""The profiler callback's files, and the bottleneck report's figures and verdicts."""

import json
import time

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, schedule
from torch.utils.data import DataLoader, Dataset, TensorDataset

from src.callbacks.profile_report import analyse_trace, classify
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
    assert verdict["category"] in report and "carries overhead" in report
    assert (profile_dir / "report.png").read_bytes()[:4] == b"\x89PNG"


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
    assert stats.steps == 2 and stats.window_us == 2000
    assert stats.data_wait_fraction == pytest.approx(0.2)
    assert stats.ops_per_step == 3
    assert stats.mean_op_us == pytest.approx(500 / 3)  # self times 100 + 300 + 100
    assert stats.matmul_fraction == pytest.approx(0.6)
    assert stats.elementwise_fraction == pytest.approx(0.2)
    # busy: data 200 + linear 400 + relu 100 per 1000 µs step
    assert stats.idle_fraction == pytest.approx(0.3)


class SlowDataset(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        time.sleep(0.002)
        return torch.randn(8), 0


def profile_steps(step_fn, loader, tmp_path, steps=4):
    """Profile `steps` steps of a plain loop (after one warm-up) and classify the window."""
    trace = tmp_path / "trace.json"
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(trace)),
        record_shapes=True,
    ) as prof:
        batches = iter(loader)
        for _ in range(steps + 1):
            step_fn(next(batches))
            prof.step()
    stats = analyse_trace(trace)
    return stats, classify(stats)


def many_tiny_ops(batch):
    x = batch[0]
    for _ in range(200):
        x = x * 1.0001 + 0.0001
        sum(i * i for i in range(50))  # the framework's Python work between operators


def big_matmuls(batch):
    # Enough matmul work that gathering the 512-row batch stays a small share of the step,
    # even on a CPU whose matmuls are fast.
    weight = torch.randn(512, 512) / 512**0.5
    x = batch[0]
    for _ in range(24):
        x = x @ weight


def big_elementwise(batch):
    x = batch[0]
    for _ in range(6):
        x = (x * 1.0001 + 0.5).clamp(-10, 10)
    x.clone().contiguous()


def tiny_model(batch):
    torch.nn.functional.linear(batch[0], torch.randn(2, 8))


@pytest.mark.parametrize(
    ("step_fn", "data", "expected"),
    [
        (many_tiny_ops, lambda: TensorDataset(torch.randn(64, 4)), "dispatch_overhead"),
        (big_matmuls, lambda: TensorDataset(torch.randn(5 * 512, 512)), "compute_bound"),
        (big_elementwise, lambda: TensorDataset(torch.randn(5, 2_000_000)), "memory_bandwidth"),
        (tiny_model, SlowDataset, "input_or_communication"),
    ],
    ids=["tiny-ops", "matmuls", "elementwise", "slow-dataset"],
)
def test_synthetic_windows_get_the_right_verdict(tmp_path, step_fn, data, expected):
    batch_size = 1 if expected == "memory_bandwidth" else 8
    loader = DataLoader(data(), batch_size=batch_size if expected != "compute_bound" else 512)
    stats, verdict = profile_steps(step_fn, loader, tmp_path)
    assert verdict.category == expected, (verdict, stats)
