"""Read a torch.profiler Chrome trace and say what limits the recorded training steps.

The trace is measured, not modelled: every figure in the report is computed from the events
of the recorded window (operators, device kernels, data-loader and collective spans), and the
verdict follows from those figures by the thresholds below, so a reader can check it.
"""

import json
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

MATMUL = re.compile(
    r"addmm|aten::mm\b|bmm|matmul|conv|gemm|cutlass|cublas|xmma|flash|fmha|attention|sm\d\d_",
    re.IGNORECASE,
)
COPY = re.compile(
    r"copy|_to_copy|aten::to\b|clone|contiguous|aten::cat\b|aten::stack|index|gather|scatter"
    r"|memcpy|memset|pad",
    re.IGNORECASE,
)
ELEMENTWISE = re.compile(
    r"add|sub|mul|div|relu|gelu|silu|sigmoid|tanh|exp|log|pow|sqrt|threshold|where|clamp|neg"
    r"|abs|softmax|dropout|norm|mean|sum|pool|_foreach|elementwise|vectorized|reduce|nll|fill"
    r"|zero",
    re.IGNORECASE,
)
COLLECTIVE = re.compile(
    r"nccl|gloo|c10d|all_?reduce|broadcast|all_?gather|reduce_?scatter|barrier", re.IGNORECASE
)
DATA_LOADING = re.compile(r"enumerate\(DataLoader\)|train_dataloader_next")

# Thresholds of the verdict, as fractions (see `classify`).
WAIT_SHARE = 0.30  # of the window spent waiting for data or in collectives
IDLE_SHARE = 0.50  # of the window with no operator (CPU) or no kernel (GPU) running
TINY_OP_US = 10.0  # mean operator/kernel duration below which ops count as tiny
DOMINANT_SHARE = 0.50  # of operator time in one class of operators

CATEGORIES = {
    "input_or_communication": (
        "Waiting for input, collectives or slow ranks",
        [
            "Fix the actual wait: more DataLoader workers, `pin_memory`, precomputed "
            "transforms, faster storage; for collectives, larger buckets, overlapping "
            "communication, or balancing the ranks.",
        ],
    ),
    "dispatch_overhead": (
        "Launch/dispatch overhead: many tiny operators, a busy CPU and gaps between them",
        [
            "Fuse operators: `torch.compile` (`+compile=default`), fused optimizers "
            "(`foreach`/`fused`), CUDA graphs (`+compile=reduce-overhead`) on GPU.",
            "Do more work per operator: a larger batch, fewer per-step Python calls "
            "(logging, `.item()`, progress-bar refreshes).",
        ],
    ),
    "memory_bandwidth": (
        "Memory bandwidth: large operators dominated by copies and element-wise work",
        [
            "Remove copies and intermediates (`.contiguous()`, dtype casts, `cat`), use "
            "fused implementations (fused norms/activations, `torch.compile`), keep tensors "
            "in bf16.",
        ],
    ),
    "compute_bound": (
        "Compute bound: large matrix multiplies and convolutions dominate",
        [
            "This is where the time should go. Gain more by shape and precision: bf16 "
            "(`trainer.precision=bf16-mixed`), batch and hidden sizes that are multiples of "
            "8/64, then check that numerics still match.",
        ],
    ),
    "mixed": (
        "No single bottleneck",
        ["Look at the top operators below and profile a longer window (`+profile=long`)."],
    ),
}


@dataclass
class WindowStats:
    """Figures of one recorded window of training steps (times in microseconds)."""

    device: str
    steps: int
    window_us: float
    ops_per_step: float
    mean_op_us: float
    idle_fraction: float
    matmul_fraction: float
    copy_fraction: float
    elementwise_fraction: float
    data_wait_fraction: float
    collective_fraction: float
    top_ops: list[tuple[str, float, int]] = field(default_factory=list)

    @property
    def memory_fraction(self) -> float:
        return self.copy_fraction + self.elementwise_fraction


@dataclass
class Verdict:
    category: str
    title: str
    reasons: list[str]
    next_steps: list[str]


def analyse_trace(path: str | Path) -> WindowStats:
    """Compute the window's figures from a Chrome trace exported by torch.profiler."""
    events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    if not steps:
        raise ValueError(f"{path} holds no ProfilerStep spans: is it a torch.profiler trace?")
    windows = _merge([(e["ts"], e["ts"] + e["dur"]) for e in steps])
    window_us = sum(end - start for start, end in windows)

    def inside(event):
        return any(start <= event["ts"] < end for start, end in windows)

    data_spans = _merge([_span(e) for e in events if DATA_LOADING.search(e["name"]) and inside(e)])
    collectives = [e for e in events if COLLECTIVE.search(e["name"]) and inside(e)]
    kernels = [
        e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and inside(e)
    ]
    ops = [
        e for e in events if e.get("cat") == "cpu_op" and inside(e) and not _within(e, data_spans)
    ]

    if kernels:  # GPU: the device's own timeline
        device, work = "cuda", [(e["name"], e["dur"]) for e in kernels]
        busy = _merge([_span(e) for e in kernels])
    else:  # CPU: operators' self time, so nested calls are not counted twice
        device, work = "cpu", _self_times(ops)
        busy = _merge([_span(e) for e in _top_level(ops)] + data_spans)
    busy_us = sum(end - start for start, end in busy)
    data_us = sum(end - start for start, end in data_spans)
    total_work = sum(duration for _, duration in work) or 1.0

    def share(pattern, exclude=()):
        return (
            sum(
                d
                for name, d in work
                if pattern.search(name) and not any(p.search(name) for p in exclude)
            )
            / total_work
        )

    by_name: dict[str, list[float]] = defaultdict(list)
    for name, duration in work:
        by_name[name].append(duration)
    top = sorted(((n, sum(d) / 1e3, len(d)) for n, d in by_name.items()), key=lambda r: -r[1])
    return WindowStats(
        device=device,
        steps=len(steps),
        window_us=window_us,
        ops_per_step=len(work) / len(steps),
        mean_op_us=total_work / max(len(work), 1),
        idle_fraction=max(0.0, 1.0 - busy_us / window_us),
        matmul_fraction=share(MATMUL),
        copy_fraction=share(COPY, exclude=(MATMUL,)),
        elementwise_fraction=share(ELEMENTWISE, exclude=(MATMUL, COPY)),
        data_wait_fraction=data_us / window_us,
        collective_fraction=sum(e["dur"] for e in collectives) / window_us,
        top_ops=top[:10],
    )


def classify(stats: WindowStats) -> Verdict:
    """The bottleneck category of a window, with the figures that decided it."""
    waiting = stats.data_wait_fraction + stats.collective_fraction
    idle_what = "no kernel running on the GPU" if stats.device == "cuda" else "no operator running"
    figures = {
        "wait": f"{waiting:.0%} of the window waits for data ({stats.data_wait_fraction:.0%}) "
        f"or collectives ({stats.collective_fraction:.0%}) (threshold {WAIT_SHARE:.0%})",
        "idle": f"{stats.idle_fraction:.0%} of the window has {idle_what} "
        f"(threshold {IDLE_SHARE:.0%}); {stats.ops_per_step:.0f} operators per step, "
        f"{stats.mean_op_us:.1f} µs each on average",
        "matmul": f"matrix multiplies and convolutions take {stats.matmul_fraction:.0%} of "
        f"operator time (threshold {DOMINANT_SHARE:.0%})",
        "memory": f"copies ({stats.copy_fraction:.0%}) and element-wise operators "
        f"({stats.elementwise_fraction:.0%}) take {stats.memory_fraction:.0%} of operator time",
    }
    if waiting >= WAIT_SHARE:
        category, reasons = "input_or_communication", [figures["wait"]]
    elif stats.idle_fraction >= IDLE_SHARE or (
        stats.mean_op_us < TINY_OP_US and stats.idle_fraction >= IDLE_SHARE / 2
    ):
        category, reasons = "dispatch_overhead", [figures["idle"]]
    elif stats.matmul_fraction >= DOMINANT_SHARE:
        category, reasons = "compute_bound", [figures["matmul"], figures["idle"]]
    elif stats.memory_fraction >= DOMINANT_SHARE:
        category, reasons = "memory_bandwidth", [figures["memory"], figures["idle"]]
    else:
        category, reasons = "mixed", [figures["matmul"], figures["memory"], figures["idle"]]
    title, next_steps = CATEGORIES[category]
    return Verdict(category, title, reasons, next_steps)


def write_report(stats: WindowStats, verdict: Verdict, out_dir: Path, name: str = "report"):
    """Write `<name>.md` (verdict, figures, next steps) and `<name>.png` into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    figure = out_dir / f"{name}.png"
    plot_window(stats, figure)
    lines = [
        "# Bottleneck report",
        "",
        f"**Verdict: {verdict.title}** (`{verdict.category}`)",
        "",
        *[f"- {reason}" for reason in verdict.reasons],
        "",
        "## Suggested next steps",
        "",
        *[f"- {step}" for step in verdict.next_steps],
        "",
        "## Figures of the recorded window",
        "",
        "| figure | value |",
        "|---|---|",
        f"| device timeline | {stats.device} |",
        f"| recorded steps | {stats.steps} |",
        f"| mean step time (profiled) | {stats.window_us / stats.steps / 1e3:.3f} ms |",
        f"| {'kernels' if stats.device == 'cuda' else 'operators'} per step | "
        f"{stats.ops_per_step:.0f} |",
        f"| mean operator duration | {stats.mean_op_us:.1f} µs |",
        f"| idle (gaps between operations) | {stats.idle_fraction:.1%} |",
        f"| matmul / convolution share | {stats.matmul_fraction:.1%} |",
        f"| copy share | {stats.copy_fraction:.1%} |",
        f"| element-wise share | {stats.elementwise_fraction:.1%} |",
        f"| waiting for the next batch | {stats.data_wait_fraction:.1%} |",
        f"| collectives | {stats.collective_fraction:.1%} |",
        "",
        "## Top operators by self time",
        "",
        "| operator | total ms | calls |",
        "|---|---|---|",
        *[f"| `{op}` | {ms:.3f} | {calls} |" for op, ms, calls in stats.top_ops],
        "",
        f"![time shares]({figure.name})",
        "",
        "## Read this with care",
        "",
        "A profile carries overhead: recording every operator slows each one down, most for "
        "the smallest, so shares are indicative and step times are longer than in a normal "
        "run. Measure throughput with the profiler off (the `perf/*` metrics of every run, or "
        "`make bench`), and compare before and after a change the same way.",
        "",
    ]
    (out_dir / f"{name}.md").write_text("\n".join(lines))
    (out_dir / f"{name}.json").write_text(
        json.dumps({"verdict": asdict(verdict), "stats": asdict(stats)}, indent=2)
    )


def plot_window(stats: WindowStats, path: Path) -> None:
    """Where the window's time went (left) and the top operators by self time (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4), width_ratios=(1, 1.6))
    shares = {
        "waiting for data": stats.data_wait_fraction,
        "collectives": stats.collective_fraction,
        "idle / dispatch": stats.idle_fraction,
    }
    busy = max(0.0, 1.0 - sum(shares.values()))
    shares |= {
        "matmul / conv": busy * stats.matmul_fraction,
        "copies": busy * stats.copy_fraction,
        "element-wise": busy * stats.elementwise_fraction,
        "other operators": busy * max(0.0, 1 - stats.matmul_fraction - stats.memory_fraction),
    }
    left.barh(list(shares), [100 * v for v in shares.values()], color="tab:blue")
    left.set_xlabel("% of the recorded window")
    left.set_xlim(0, 100)
    left.invert_yaxis()
    names = [op if len(op) <= 40 else op[:37] + "..." for op, _, _ in stats.top_ops]
    right.barh(names, [ms for _, ms, _ in stats.top_ops], color="tab:orange")
    right.set_xlabel("self time in the window (ms)")
    right.invert_yaxis()
    figure.suptitle(f"Profiled window: {stats.steps} steps on {stats.device}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _span(event: dict) -> tuple[float, float]:
    return event["ts"], event["ts"] + event["dur"]


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of intervals, as sorted disjoint intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _within(event: dict, spans: list[tuple[float, float]]) -> bool:
    return any(start <= event["ts"] and event["ts"] + event["dur"] <= end for start, end in spans)


def _nesting(ops: list[dict]):
    """Yield (op, parent or None) per thread, from start times and durations."""
    by_thread: dict[object, list[dict]] = defaultdict(list)
    for op in ops:
        by_thread[(op.get("pid"), op.get("tid"))].append(op)
    for thread_ops in by_thread.values():
        stack: list[dict] = []
        for op in sorted(thread_ops, key=lambda e: (e["ts"], -e["dur"])):
            while stack and op["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
                stack.pop()
            yield op, (stack[-1] if stack else None)
            stack.append(op)


def _top_level(ops: list[dict]) -> list[dict]:
    return [op for op, parent in _nesting(ops) if parent is None]


def _self_times(ops: list[dict]) -> list[tuple[str, float]]:
    """(name, self time) of each operator: its duration minus that of its child operators."""
    child_time: dict[int, float] = defaultdict(float)
    ordered = list(_nesting(ops))
    for op, parent in ordered:
        if parent is not None:
            child_time[id(parent)] += op["dur"]
    return [(op["name"], max(0.0, op["dur"] - child_time[id(op)])) for op, _ in ordered]
