"""Training throughput of QwenLM against transformers' Qwen3 / Qwen3-Next on the same weights.

    python scripts/bench_lm.py                        # conf/model tiny configs, B=16, T=256
    python scripts/bench_lm.py --quick                # a few seconds: smaller models, one repeat
    python scripts/bench_lm.py --output bench.md      # also write the Markdown section
    python scripts/bench_lm.py --device cuda --models qwen3_0_6b   # a GPU, any conf/model config
    python scripts/bench_lm.py --models dense --vocab-size 151936 --hidden-size 256 --layers 2 \
        --batch-size 2 --seq-len 2048 --memory            # Qwen3's vocabulary: peak memory too
    python scripts/bench_lm.py --finetune --models qwen3_0_6b --batch-size 1 --seq-len 512
                                                      # full vs LoRA vs QLoRA, act. checkpointing
    python scripts/bench_lm.py --finetune --models qwen3_0_6b --batch-size 1 --seq-len 512 \
        --variants lora qlora                         # LoRA against QLoRA alone
    python scripts/bench_lm.py --rollouts             # GRPO rollouts vs transformers' generate

For each model (dense, hybrid) and precision (fp32, bf16-mixed via torch.autocast), both
implementations get the same config, weights (QwenLM is saved with save_pretrained and loaded by
transformers), batch, sequence length and AdamW settings. Each computes the next-token loss its
own way: QwenLM from its hidden states in chunks of `model.loss_chunk_size` rows, transformers
from full logits. Their logits and losses are compared before anything is timed. A timed step
is forward + backward + optimizer step, timed after the device has finished it (CUDA runs
asynchronously). The first step of each is reported apart
(cold start), one more is a warm-up, then the two alternate, `--repeats` times, their order
swapped every repeat; the table shows medians. Model FLOPs utilisation uses
QwenLM.flops_per_token against the device's peak per precision: a GPU's dense datasheet figure
(src/callbacks/measurement/peak_flops.py), or, on a CPU or an unlisted GPU, that module's matmul
probe, run here.
`--memory` adds each implementation's peak memory over two training steps, each in a fresh
process: its peak resident memory on a CPU, the most CUDA memory it allocated on a GPU.
`--finetune` compares fine-tuning variants instead: full, LoRA and QLoRA, with activation
checkpointing off and on, for QwenLM and transformers' model (`scripts/bench_finetune.py`).
"""

import argparse
import ctypes
import gc
import json
import resource
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from benchmarks import (
    CONF_DIR,
    in_fresh_process,
    machine_line,
    markdown,
    model_config,
    publish,
)

from src.callbacks.measurement.peak_flops import gpu_peak_flops, measure_matmul_flops, synchronize
from src.models.language.qwen import QwenConfig, QwenLM
from src.utils.contracts import IGNORE_INDEX
from src.utils.error_boundary import exit_in_one_line
from src.utils.transformers_fallback import use_pytorch_kernels_in_transformers

# Short names for the tiny configs; `--models` also takes any conf/model/<name>.yaml of the LM.
MODELS = {"dense": "qwen3_tiny", "hybrid": "qwen3_next_tiny"}
IMPLEMENTATIONS = ("ours", "transformers")
PRECISIONS = ("fp32", "bf16-mixed")
COLUMNS = (
    "model", "precision", "params", "ours tok/s", "transformers tok/s", "speedup",
    "ours MFU", "transformers MFU", "cold start ours / transformers", "max abs Δ logits",
    "rel Δ loss",
)  # fmt: skip
# --finetune's adapters (scripts/bench_finetune.py), each with activation checkpointing off and on.
FINETUNE_ADAPTERS = ("full", "lora", "qlora")
MEMORY_COLUMNS = ("ours peak memory", "transformers peak memory", "memory ratio")
# --vocab-size, --hidden-size, --layers: the config keys they resize.
RESIZING = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "layers": "num_hidden_layers"}


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
    parser.add_argument("--vocab-size", type=int, help="resize every model's vocabulary")
    parser.add_argument("--hidden-size", type=int, help="resize every model's hidden size")
    parser.add_argument("--layers", type=int, help="resize every model's decoder layers")
    parser.add_argument("--memory", action="store_true", help="measure peak memory too")
    parser.add_argument(
        "--finetune",
        action="store_true",
        help="instead: full fine-tuning vs LoRA vs QLoRA r=16, activation checkpointing on and off",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=FINETUNE_ADAPTERS,
        default=list(FINETUNE_ADAPTERS),
        help="--finetune: which of them (each with activation checkpointing off and on)",
    )
    parser.add_argument(
        "--implementations",
        nargs="+",
        choices=IMPLEMENTATIONS,
        default=["ours"],
        help="--finetune: QwenLM (ours), transformers' model (peft's LoRA, no QLoRA) or both",
    )
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


def mfu_peak(dtype: torch.dtype, size: int, device: torch.device) -> tuple[float, str]:
    """The peak MFU is measured against, and where it comes from."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if (peak := gpu_peak_flops(name, dtype)) is not None:
            return peak, f"{name} datasheet, dense"
    return measure_matmul_flops(dtype, size, device=device), f"measured {size}x{size} matmul"


class Runner:
    """One implementation's model, optimizer and a `step()` that trains on a fixed batch."""

    def __init__(self, model, ids: torch.Tensor, bf16: bool, calls_transformers: bool):
        self.model = model.train()
        self.ids = ids
        self.bf16 = bf16
        self.calls_transformers = calls_transformers
        trained = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=1e-4, weight_decay=0.1)

    def autocast(self):
        autocast = torch.autocast(self.ids.device.type, dtype=torch.bfloat16)
        return autocast if self.bf16 else nullcontext()

    def logits(self) -> torch.Tensor:
        with self.autocast():
            if self.calls_transformers:
                return self.model(input_ids=self.ids, use_cache=False).logits
            return self.model(self.ids)

    def loss(self) -> torch.Tensor:
        """The mean next-token loss over the batch, as each implementation computes it."""
        with self.autocast():
            if self.calls_transformers:
                return self.model(input_ids=self.ids, labels=self.ids, use_cache=False).loss
            labels = F.pad(self.ids[:, 1:], (0, 1), value=IGNORE_INDEX)  # labels[t] = ids[t + 1]
            loss_sum, tokens, _ = self.model(self.ids, labels=labels)
            return loss_sum / tokens

    def step(self) -> None:
        self.loss().backward()
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


def load(implementation: str, folder: str, device: torch.device):
    """The model of `implementation` ("ours" or "transformers") from a transformers folder."""
    if implementation == "ours":
        return QwenLM.from_pretrained(folder).to(device)
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder).to(device)


def batch_of(vocab_size: int, args) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (args.batch_size, args.seq_len), generator=generator)
    return ids.to(args.device)


def child_options(args) -> str:
    """The arguments a child process needs, as JSON."""
    keys = ("batch_size", "seq_len", "device", "steps", "repeats")
    return json.dumps({k: str(v) if k == "device" else v for k, v in vars(args).items()
                       if k in keys})  # fmt: skip


def child_args(options: str) -> argparse.Namespace:
    use_pytorch_kernels_in_transformers()
    args = argparse.Namespace(**json.loads(options))
    args.device = torch.device(args.device)
    return args


def reset_peak(device: torch.device) -> None:
    """Start `peak_bytes` afresh from what this process holds now."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    gc.collect()
    try:  # hand freed heap memory back, then reset VmHWM to the resident size (Linux 4.0+)
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not glibc / Linux: the peak counts from the process's start


def peak_bytes(device: torch.device) -> int:
    """This process's peak memory so far: CUDA memory allocated, or resident memory on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    # VmHWM where there is one: Linux carries the parent's peak at fork time into a child's
    # ru_maxrss across exec, while VmHWM belongs to this process's own memory.
    status = Path("/proc/self/status")
    if status.is_file():
        return int(status.read_text().split("VmHWM:")[1].split()[0]) * 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS


def peak_memory(implementation: str, folder: str, precision: str, args) -> int:
    """Bytes at the peak of two training steps of `implementation`, in a fresh process."""
    call = (
        f"peak_memory_here({implementation!r}, {folder!r}, {precision!r}, {child_options(args)!r})"
    )
    return in_fresh_process("bench_lm", call)["peak_bytes"]


def peak_memory_here(implementation: str, folder: str, precision: str, options: str) -> None:
    """`peak_memory`'s child: train two steps, print the peak."""
    args = child_args(options)
    model = load(implementation, folder, args.device)
    runner = Runner(model, batch_of(model.config.vocab_size, args), precision == "bf16-mixed",
                    implementation == "transformers")  # fmt: skip
    runner.timed(2)
    print(json.dumps({"peak_bytes": peak_bytes(args.device)}))


def resized(config, args):
    changes = {key: getattr(args, arg) for arg, key in RESIZING.items() if getattr(args, arg)}
    if "num_hidden_layers" in changes:
        changes["layer_types"] = None  # the model type's default pattern, at the new depth
    return QwenConfig.from_dict({**config.to_dict(), **changes})


def resizing_line(args) -> str:
    return ", ".join(f"{key}={getattr(args, arg)}" for arg, key in RESIZING.items()
                     if getattr(args, arg))  # fmt: skip


def compare(kind: str, precision: str, args, peaks: dict[str, float]) -> dict[str, str]:
    config = resized(model_config(MODELS.get(kind, kind), args.quick), args)
    torch.manual_seed(0)
    bf16 = precision == "bf16-mixed"
    with tempfile.TemporaryDirectory() as folder:
        QwenLM(config).save_pretrained(folder)
        memory = {}
        if args.memory:
            memory = {name: peak_memory(name, folder, precision, args) for name in IMPLEMENTATIONS}
        ours, theirs = (load(name, folder, args.device) for name in IMPLEMENTATIONS)
    ids = batch_of(config.vocab_size, args)
    runners = {
        "ours": Runner(ours, ids, bf16, False),
        "transformers": Runner(theirs, ids, bf16, True),
    }
    with torch.no_grad():
        difference = (runners["ours"].logits() - runners["transformers"].logits()).abs().max()
        losses = {name: runner.loss() for name, runner in runners.items()}
    loss_difference = (losses["ours"] - losses["transformers"]).abs() / losses["transformers"]

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
    row = {
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
        "rel Δ loss": f"{loss_difference:.1e}",
    }
    if memory:
        row["ours peak memory"] = f"{memory['ours'] / 2**30:.2f} GiB"
        row["transformers peak memory"] = f"{memory['transformers'] / 2**30:.2f} GiB"
        row["memory ratio"] = f"{memory['ours'] / memory['transformers']:.2f}x"
    return row


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
    if args.finetune:
        from bench_finetune import FINETUNE_COLUMNS, finetune

        rows = [
            r for k in args.models for p in args.precisions for r in finetune(k, p, args, peaks)
        ]
        table = markdown(rows, FINETUNE_COLUMNS)
    else:
        rows = [compare(k, p, args, peaks) for k in args.models for p in args.precisions]
        table = markdown(rows, COLUMNS + MEMORY_COLUMNS if args.memory else COLUMNS)
    command = "python scripts/bench_lm.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report = "\n".join([
        machine_line(transformers=transformers.__version__),
        f"Device: {args.device}; MFU peak: {peaks['fp32'][0] / 1e9:,.0f} GFLOP/s fp32 "
        f"({peaks['fp32'][1]}), {peaks['bf16'][0] / 1e9:,.0f} GFLOP/s bf16 ({peaks['bf16'][1]})",
        f"Batch {args.batch_size} x {args.seq_len} tokens, {args.steps} steps per round, "
        f"median of {args.repeats} rounds; command: `{command.strip()}`",
        *([f"Configs resized: {resizing}"] if (resizing := resizing_line(args)) else []),
        "",
        table,
    ])  # fmt: skip
    publish(report, args.output)
    return rows


if __name__ == "__main__":
    if "--rollouts" in sys.argv:  # GRPO's sampling against transformers' generate
        from bench_rollouts import main as rollouts

        sys.argv.remove("--rollouts")
        exit_in_one_line(rollouts)()
    else:
        exit_in_one_line(main)()
