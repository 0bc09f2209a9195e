"""Training throughput of QwenLM against transformers' Qwen3 / Qwen3-Next on the same weights.

    python scripts/bench_lm.py                        # conf/model tiny configs, B=16, T=256
    python scripts/bench_lm.py --quick                # a few seconds: smaller models, one repeat
    python scripts/bench_lm.py --output bench.md      # also write the Markdown section
    python scripts/bench_lm.py --device cuda --models qwen3_0_6b   # a GPU, any conf/model config

For each model (dense, hybrid) and precision (fp32, bf16-mixed via torch.autocast), both
implementations get the same config, weights (QwenLM is saved with save_pretrained and loaded by
transformers), batch, sequence length and AdamW settings. Their logits are compared before
anything is timed. A timed step is forward + backward + optimizer step, timed after the
device has finished it (CUDA runs asynchronously). The first step of each is reported apart
(cold start), one more is a warm-up, then the two alternate, `--repeats` times, their order
swapped every repeat; the table shows medians. Model FLOPs utilisation uses
QwenLM.flops_per_token against the device's peak per precision: a GPU's dense datasheet figure
(src/callbacks/peak_flops.py), or, on a CPU or an unlisted GPU, a matmul peak measured here.
"""

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

from src.callbacks.peak_flops import gpu_peak_flops
from src.models.qwen import QwenLM
from src.run.benchmarks import CONF_DIR, machine_line, markdown, model_config, publish
from src.utils.transformers_fallback import use_pytorch_kernels_in_transformers

# Short names for the tiny configs; `--models` also takes any conf/model/<name>.yaml of the LM.
MODELS = {"dense": "qwen3_tiny", "hybrid": "qwen3_next_tiny"}
PRECISIONS = ("fp32", "bf16-mixed")
COLUMNS = (
    "model", "precision", "params", "ours tok/s", "transformers tok/s", "speedup",
    "ours MFU", "transformers MFU", "cold start ours / transformers", "max abs Δ logits",
)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: seconds")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per implementation")
    parser.add_argument("--steps", type=int, default=3, help="training steps per timed round")
    parser.add_argument(
        "--models",
        nargs="+",
        default=sorted(MODELS),
        type=model_name,
        help=f"{', '.join(sorted(MODELS))} or a conf/model config name (e.g. qwen3_0_6b)",
    )
    parser.add_argument(
        "--device",
        type=torch.device,
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where to train: cuda when available, else cpu",
    )
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument("--output", type=Path, help="write the Markdown table there too")
    parser.add_argument("--profile", action="store_true", help="print each one's costliest ops")
    args = parser.parse_args(argv)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this machine has no CUDA device")
    if args.quick:
        args.batch_size, args.seq_len, args.repeats, args.steps = 2, 80, 1, 1
    return args


def model_name(name: str) -> str:
    """A short name of MODELS, or the name of an LM config in conf/model/."""
    config = MODELS.get(name, name)
    if not (CONF_DIR / "model" / f"{config}.yaml").is_file():
        raise argparse.ArgumentTypeError(f"{name!r} is neither of {sorted(MODELS)} nor a config")
    return name


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a clock read after it covers that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(dtype: torch.dtype, size: int, device: torch.device) -> float:
    """Best FLOP/s of a square matmul on `device`."""
    a, b = (torch.randn(size, size, dtype=dtype, device=device) for _ in range(2))
    a @ b  # warm-up
    best = 0.0
    for _ in range(10):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best


def mfu_peak(dtype: torch.dtype, size: int, device: torch.device) -> tuple[float, str]:
    """The peak MFU is measured against, and where it comes from."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if (peak := gpu_peak_flops(name, dtype)) is not None:
            return peak, f"{name} datasheet, dense"
    return matmul_peak(dtype, size, device), f"measured {size}x{size} matmul"


class Runner:
    """One implementation's model, optimizer and a `step()` that trains on a fixed batch."""

    def __init__(self, model, ids: torch.Tensor, bf16: bool, calls_transformers: bool):
        self.model = model.train()
        self.ids = ids
        self.bf16 = bf16
        self.calls_transformers = calls_transformers
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

    def logits(self) -> torch.Tensor:
        autocast = torch.autocast(self.ids.device.type, dtype=torch.bfloat16)
        with autocast if self.bf16 else nullcontext():
            if self.calls_transformers:
                return self.model(input_ids=self.ids, use_cache=False).logits
            return self.model(self.ids)

    def step(self) -> None:
        logits = self.logits()
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), self.ids[:, 1:].flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def timed(self, steps: int) -> float:
        """Seconds for `steps` training steps, finished on the device."""
        synchronize(self.ids.device)
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        synchronize(self.ids.device)
        return time.perf_counter() - start


def profile(runner: Runner) -> str:
    """The ops taking the most time in one training step, by torch.profiler."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    on_gpu = runner.ids.device.type == "cuda"
    if on_gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        runner.step()
        synchronize(runner.ids.device)
    sort_by = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    return profiler.key_averages().table(sort_by=sort_by, row_limit=8)


def compare(kind: str, precision: str, args, peaks: dict[str, float]) -> dict[str, str]:
    import transformers

    config = model_config(MODELS.get(kind, kind), args.quick)
    torch.manual_seed(0)
    ours = QwenLM(config)
    with tempfile.TemporaryDirectory() as folder:
        ours.save_pretrained(folder)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ours, theirs = ours.to(args.device), theirs.to(args.device)
    ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), device=args.device)
    bf16 = precision == "bf16-mixed"
    runners = {
        "ours": Runner(ours, ids, bf16, False),
        "transformers": Runner(theirs, ids, bf16, True),
    }
    with torch.no_grad():
        difference = (runners["ours"].logits() - runners["transformers"].logits()).abs().max()

    cold = {name: runner.timed(1) for name, runner in runners.items()}
    for runner in runners.values():  # warm-up (oneDNN builds kernels per shape), not timed
        runner.timed(2)
    seconds = {name: [] for name in runners}
    order = list(runners)
    for _ in range(args.repeats):
        for name in order:
            seconds[name].append(runners[name].timed(args.steps))
        order.reverse()
    if args.profile:
        for name, runner in runners.items():
            print(f"\n{kind} {precision}, {name}: one step\n{profile(runner)}")
    tokens = args.batch_size * args.seq_len * args.steps
    rate = {name: tokens / statistics.median(times) for name, times in seconds.items()}
    flops = ours.flops_per_token(args.seq_len)
    peak = peaks["bf16" if bf16 else "fp32"][0]
    return {
        "model": f"{kind} ({MODELS[kind]})" if kind in MODELS else kind,
        "precision": precision,
        "params": f"{ours.num_parameters() / 1e6:.2f}M",
        "ours tok/s": f"{rate['ours']:,.0f}",
        "transformers tok/s": f"{rate['transformers']:,.0f}",
        "speedup": f"{rate['ours'] / rate['transformers']:.2f}x",
        "ours MFU": f"{rate['ours'] * flops / peak:.1%}",
        "transformers MFU": f"{rate['transformers'] * flops / peak:.1%}",
        "cold start ours / transformers": f"{cold['ours']:.2f} s / {cold['transformers']:.2f} s",
        "max abs Δ logits": f"{difference:.1e}",
    }


def main(argv: list[str] | None = None) -> list[dict[str, str]]:
    import transformers

    use_pytorch_kernels_in_transformers()
    transformers.logging.set_verbosity_error()  # its kernel-fallback notes, on every model
    transformers.utils.logging.disable_progress_bar()
    args = parse_args(argv)
    size = 512 if args.quick else 2048 if args.device.type == "cpu" else 8192
    peaks = {
        "fp32": mfu_peak(torch.float32, size, args.device),
        "bf16": mfu_peak(torch.bfloat16, size, args.device),
    }
    rows = [compare(k, p, args, peaks) for k in args.models for p in args.precisions]
    command = "python scripts/bench_lm.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report = "\n".join([
        machine_line(transformers=transformers.__version__),
        f"Device: {args.device}; MFU peak: {peaks['fp32'][0] / 1e9:,.0f} GFLOP/s fp32 "
        f"({peaks['fp32'][1]}), {peaks['bf16'][0] / 1e9:,.0f} GFLOP/s bf16 ({peaks['bf16'][1]})",
        f"Batch {args.batch_size} x {args.seq_len} tokens, {args.steps} steps per round, "
        f"median of {args.repeats} rounds; command: `{command.strip()}`",
        "",
        markdown(rows, COLUMNS),
    ])  # fmt: skip
    publish(report, args.output)
    return rows


if __name__ == "__main__":
    main()
