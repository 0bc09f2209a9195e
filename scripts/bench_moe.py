"""Mixture-of-experts training: QwenLM against transformers' Qwen3MoeForCausalLM, and its cost
against the number of experts.

    python scripts/bench_moe.py                       # 32 experts top-4, B=4, T=256; 8/64/256
    python scripts/bench_moe.py --quick               # a few seconds: toy sizes, one round
    python scripts/bench_moe.py --output moe.md       # also write the Markdown section
    python scripts/bench_moe.py --scaling-experts     # (none given) the comparison alone
    python scripts/bench_moe.py --profile             # each contender's costliest ops, one step
    python scripts/bench_moe.py --compile             # also both models under torch.compile

Comparison: one Qwen3-MoE config (every layer sparse, no shared expert, norm_topk_prob) built
three ways with the same weights: QwenLM (its experts two `F.grouped_mm` calls per layer),
transformers with `experts_implementation="grouped_mm"` (its default) and with "eager" (a
Python loop over the experts that received tokens). transformers' model is built first and
QwenLM loads its state dict. The loss is the next-token cross-entropy plus
`router_aux_loss_coef` x the load-balancing loss, as transformers trains with
`output_router_logits`; the first training step's losses are compared (fp32: they must agree
to 1e-4, the compiled models' too). A timed step is forward + backward + AdamW step. The first
step of each is reported apart (cold start, after one untimed toy step of every contender has
paid the process's one-off costs), two more are warm-up, then the contenders take turns,
`--repeats` rounds of `--steps` steps, the order rotated every round; the tables show medians.
`--compile` adds QwenLM and transformers' grouped_mm model under `torch.compile` (inductor, or
the backend it names) to the same rounds, copies of the same weights; their first step is the
compilation.

Scaling: the same model with `--scaling-experts` experts and the same top-k and expert size,
so the same active parameters per token. Their step times are interleaved in one process, split
into forward + backward and the AdamW step. Peak memory (Linux) is the growth of a process's
peak resident memory (VmHWM, reset just before the model is built) over building it and two
training steps, each measurement in a process of its own, forked from a fresh one that has
only imported the libraries; it is set beside what the stored experts need by themselves:
weights, gradients and AdamW's two moments, 16 bytes per fp32 parameter. The comparison and
the scaling study both run per precision.

bf16-mixed (torch.autocast) runs by default where the CPU has bf16 units (AVX-512 BF16, AMX);
elsewhere it would be emulated and only fp32 runs, unless `--precisions` asks for it.
"""

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from benchmarks import in_fresh_process, machine_line, markdown, publish

from src.callbacks.measurement.peak_flops import measure_matmul_flops
from src.models.language.qwen import QwenConfig, QwenLM
from src.models.language.qwen.transformers_format.state_dict_adapter import adapter_for
from src.utils.contracts import IGNORE_INDEX
from src.utils.error_boundary import exit_in_one_line
from src.utils.hardware import cpu_bf16_units, read_cpu_flags

PRECISIONS = ("fp32", "bf16-mixed")
# The contenders of the comparison: QwenLM, then transformers with each experts implementation.
CONTENDERS = ("ours", "transformers grouped_mm", "transformers eager")
# With --compile, also these two under torch.compile.
COMPILED = ("ours compiled", "transformers grouped_mm compiled")
# The implementations of the scaling study, and the experts implementation of each.
IMPLEMENTATIONS = {"ours": "", "transformers": "grouped_mm"}
LOSS_TOLERANCE = 1e-4  # first-step losses, fp32, absolute
AUX_LOSS_COEF = 0.001  # transformers' default router_aux_loss_coef
COLUMNS = (
    "precision", "ours tok/s", "transformers grouped_mm tok/s", "transformers eager tok/s",
    "speedup vs grouped_mm", "speedup vs eager", "cold start ours / grouped_mm / eager",
    "first-step Δ loss vs grouped_mm / eager", "numerics",
)  # fmt: skip
COMPILED_COLUMNS = (
    "precision", "ours compiled tok/s", "transformers grouped_mm compiled tok/s",
    "speedup compiled vs compiled", "ours compiled vs eager", "compilation ours / transformers",
    "first-step Δ loss vs ours eager / transformers compiled",
)  # fmt: skip
SCALING_COLUMNS = (
    "precision", "implementation", "experts", "expert params", "step", "forward + backward",
    "AdamW", "step vs fewest experts", "peak memory growth", "experts' weights, grads, AdamW",
    "the rest",
)  # fmt: skip
# --quick: toy sizes, the same architecture.
QUICK = dict(batch_size=2, seq_len=32, vocab_size=256, hidden_size=64, layers=2, experts=8,
             top_k=2, moe_intermediate_size=32, scaling_experts=[4, 16], repeats=1,
             steps=1)  # fmt: skip
BYTES_PER_TRAINED_PARAM = 16  # fp32 weight, gradient, AdamW exp_avg and exp_avg_sq


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="toy sizes, one round: seconds (QUICK)"
    )
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers, all sparse")
    parser.add_argument("--experts", type=int, default=32, help="experts of the comparison")
    parser.add_argument("--top-k", type=int, default=4, help="experts per token")
    parser.add_argument("--moe-intermediate-size", type=int, default=128)
    parser.add_argument(
        "--scaling-experts",
        type=int,
        nargs="*",
        default=[8, 64, 256],
        help="expert counts of the scaling study; none: skip it",
    )
    parser.add_argument(
        "--scaling-implementations",
        nargs="+",
        choices=sorted(IMPLEMENTATIONS),
        default=list(IMPLEMENTATIONS),
        help="who the scaling study trains (transformers: its grouped_mm experts)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the peak memory")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per contender")
    parser.add_argument("--steps", type=int, default=3, help="training steps per timed round")
    parser.add_argument(
        "--precisions",
        nargs="+",
        choices=PRECISIONS,
        help="default: fp32, and bf16-mixed where the CPU has bf16 units",
    )
    parser.add_argument("--output", type=Path, help="write the Markdown report there too")
    parser.add_argument("--profile", action="store_true", help="print each one's costliest ops")
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        metavar="BACKEND",
        help="also ours and transformers' under torch.compile, with BACKEND (default inductor)",
    )
    args = parser.parse_args(argv)
    if args.quick:  # toy sizes for what the command line leaves at its default
        for key, value in QUICK.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    if not memory_measurable():
        args.no_memory = True  # no way to reset and read a process's peak here
    if args.precisions is None:
        args.precisions = list(PRECISIONS) if bf16_units() else ["fp32"]
    if args.hidden_size % 32 or args.moe_intermediate_size % 8:
        parser.error("--hidden-size must be a multiple of 32, --moe-intermediate-size of 8")
    if not 0 < args.top_k <= min([args.experts, *args.scaling_experts]):
        parser.error("--top-k must be at least 1 and at most every expert count")
    return args


def bf16_units() -> str | None:
    """This CPU's native bf16 units ("AVX-512 BF16", "AMX"), None without any (or unknown)."""
    return cpu_bf16_units(read_cpu_flags() or ())


def moe_config(args, experts: int) -> QwenConfig:
    """A Qwen3-MoE decoder of the arguments' sizes with `experts` experts in every layer."""
    head_dim = args.hidden_size // 4
    return QwenConfig(
        model_type="qwen3_moe",
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=2 * args.hidden_size,  # the dense MLP's: no layer has one here
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        tie_word_embeddings=False,
        num_experts=experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_intermediate_size,
        shared_expert_intermediate_size=0,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=AUX_LOSS_COEF,
    )


def transformers_model(config: QwenConfig, experts_implementation: str):
    """transformers' Qwen3MoeForCausalLM of `config`, returning the aux loss in its loss."""
    import transformers

    values = adapter_for(config).config_to_hf(config)
    hf_config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    hf_config.output_router_logits = True  # adds router_aux_loss_coef x the aux loss
    return transformers.AutoModelForCausalLM.from_config(
        hf_config, experts_implementation=experts_implementation
    )


def expert_params(config: QwenConfig) -> int:
    """The parameters of the routed experts, all layers (all sparse here)."""
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size
    return config.num_hidden_layers * config.num_experts * per_expert


def active_params(config: QwenConfig, total: int) -> int:
    """The parameters one token uses: all but the experts it is not routed to."""
    return total - expert_params(config) * (config.num_experts - config.num_experts_per_tok) // (
        config.num_experts
    )


class Runner:
    """One contender's model, its AdamW and a `step()` that trains on a fixed batch."""

    def __init__(self, model, ids: torch.Tensor, bf16: bool, calls_transformers: bool):
        self.model = model.train()
        self.ids = ids
        self.bf16 = bf16
        self.calls_transformers = calls_transformers
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

    def autocast(self):
        return torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else nullcontext()

    def loss(self) -> torch.Tensor:
        """Mean next-token loss + router_aux_loss_coef x load-balancing loss."""
        with self.autocast():
            if self.calls_transformers:
                return self.model(input_ids=self.ids, labels=self.ids, use_cache=False).loss
            labels = F.pad(self.ids[:, 1:], (0, 1), value=IGNORE_INDEX)  # labels[t] = ids[t + 1]
            loss_sum, tokens, _ = self.model(self.ids, labels=labels)
            aux = self.model.router_aux_loss()
            return loss_sum / tokens + self.model.config.router_aux_loss_coef * aux

    def step(self) -> tuple[float, float, float]:
        """One training step: its loss, seconds of forward + backward, seconds of AdamW."""
        start = time.perf_counter()
        loss = self.loss()
        loss.backward()
        middle = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item(), middle - start, time.perf_counter() - middle

    def timed(self, steps: int) -> tuple[float, float]:
        """Seconds of forward + backward and of AdamW over `steps` steps."""
        phases = [self.step()[1:] for _ in range(steps)]
        return sum(p[0] for p in phases), sum(p[1] for p in phases)


def interleaved(runners: dict[str, Runner], args) -> dict[str, dict[str, float]]:
    """Each runner's first step (cold), then medians per step of rounds taken in turn.

    Returns per runner: `loss` and `cold` of its first step, and per-step medians of `step`,
    `forward_backward` and `optimizer` over `args.repeats` rounds of `args.steps` steps.
    """
    first = {name: runner.step() for name, runner in runners.items()}
    for runner in runners.values():  # warm-up (oneDNN builds kernels per shape), not timed
        runner.timed(2)
    rounds: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    order = list(runners)
    for _ in range(args.repeats):
        for name in order:
            rounds[name].append(runners[name].timed(args.steps))
        order = order[1:] + order[:1]  # every contender in every position in turn
    results = {}
    for name, times in rounds.items():
        results[name] = {
            "loss": first[name][0],
            "cold": first[name][1] + first[name][2],
            "step": statistics.median(f + o for f, o in times) / args.steps,
            "forward_backward": statistics.median(f for f, _ in times) / args.steps,
            "optimizer": statistics.median(o for _, o in times) / args.steps,
        }
    return results


def batch_of(vocab_size: int, args) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (args.batch_size, args.seq_len), generator=generator)


def profile(runner: Runner) -> str:
    """The ops taking the most time in one training step, by torch.profiler (self CPU time)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        runner.step()
    return profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)


def comparison(precision: str, args) -> dict[str, str]:
    """QwenLM against transformers' grouped_mm and eager experts, same config and weights."""
    config = moe_config(args, args.experts)
    torch.manual_seed(0)
    grouped = transformers_model(config, "grouped_mm")
    eager = transformers_model(config, "eager")
    eager.load_state_dict(grouped.state_dict())
    ours = QwenLM(config)
    ours.load_state_dict(grouped.state_dict())
    ids = batch_of(config.vocab_size, args)
    bf16 = precision == "bf16-mixed"
    runners = {
        "ours": Runner(ours, ids, bf16, calls_transformers=False),
        "transformers grouped_mm": Runner(grouped, ids, bf16, calls_transformers=True),
        "transformers eager": Runner(eager, ids, bf16, calls_transformers=True),
    }
    if args.compile:  # copies taken before any step: the same weights
        for name, model in zip(COMPILED, (ours, grouped), strict=True):
            compiled = torch.compile(copy.deepcopy(model), backend=args.compile)
            runners[name] = Runner(compiled, ids, bf16, calls_transformers=model is grouped)
    results = interleaved(runners, args)
    if args.profile:
        for name, runner in runners.items():
            print(f"\n{precision}, {name}: one step\n{profile(runner)}")
    tokens = args.batch_size * args.seq_len
    rate = {name: tokens / result["step"] for name, result in results.items()}
    losses = {name: result["loss"] for name, result in results.items()}
    deltas = [abs(losses["ours"] - losses[name]) for name in CONTENDERS[1:]]
    # Compiled: ours against ours eager, and against transformers compiled.
    compiled_deltas = [
        abs(losses[COMPILED[0]] - losses[name]) for name in ("ours", COMPILED[1]) if args.compile
    ]
    agree = max(deltas + compiled_deltas) < LOSS_TOLERANCE
    checked = precision == "fp32"
    row = {
        "precision": precision,
        "ours tok/s": f"{rate['ours']:,.0f}",
        "transformers grouped_mm tok/s": f"{rate['transformers grouped_mm']:,.0f}",
        "transformers eager tok/s": f"{rate['transformers eager']:,.0f}",
        "speedup vs grouped_mm": f"{rate['ours'] / rate['transformers grouped_mm']:.2f}x",
        "speedup vs eager": f"{rate['ours'] / rate['transformers eager']:.2f}x",
        "cold start ours / grouped_mm / eager": " / ".join(
            f"{results[name]['cold']:.2f} s" for name in CONTENDERS
        ),
        "first-step Δ loss vs grouped_mm / eager": " / ".join(f"{d:.1e}" for d in deltas),
        "numerics": (f"ok (< {LOSS_TOLERANCE:.0e})" if agree else "FAILED") if checked else "-",
        "first-step loss": f"{losses['ours']:.6f}",
    }
    if args.compile:
        ours_compiled, theirs_compiled = (rate[name] for name in COMPILED)
        row |= {
            "ours compiled tok/s": f"{ours_compiled:,.0f}",
            "transformers grouped_mm compiled tok/s": f"{theirs_compiled:,.0f}",
            "speedup compiled vs compiled": f"{ours_compiled / theirs_compiled:.2f}x",
            "ours compiled vs eager": f"{ours_compiled / rate['ours']:.2f}x",
            "compilation ours / transformers": " / ".join(
                f"{results[name]['cold']:.1f} s" for name in COMPILED
            ),
            "first-step Δ loss vs ours eager / transformers compiled": " / ".join(
                f"{d:.1e}" for d in compiled_deltas
            ),
        }
    return row


def build(implementation: str, config: QwenConfig):
    """The model of an implementation of IMPLEMENTATIONS."""
    if implementation == "ours":
        return QwenLM(config)
    return transformers_model(config, IMPLEMENTATIONS[implementation])


def scaling(precision: str, args) -> list[dict[str, str]]:
    """Step times of every expert count and implementation, interleaved in this process."""
    bf16 = precision == "bf16-mixed"
    ids = batch_of(args.vocab_size, args)
    runners, configs = {}, {}
    for experts in args.scaling_experts:
        configs[experts] = config = moe_config(args, experts)
        for implementation in args.scaling_implementations:
            torch.manual_seed(0)
            model = build(implementation, config)
            runners[implementation, experts] = Runner(
                model, ids, bf16, calls_transformers=implementation != "ours"
            )
    results = interleaved(runners, args)
    del runners
    gc.collect()
    rows = []
    fewest = min(args.scaling_experts)
    for (implementation, experts), result in results.items():
        stored = expert_params(configs[experts])
        reference = results[implementation, fewest]["step"]
        rows.append({
            "precision": precision,
            "implementation": label(implementation),
            "experts": str(experts),
            "expert params": f"{stored / 1e6:,.1f}M",
            "step": f"{result['step'] * 1e3:,.0f} ms",
            "forward + backward": f"{result['forward_backward'] * 1e3:,.0f} ms",
            "AdamW": f"{result['optimizer'] * 1e3:,.0f} ms",
            "step vs fewest experts": f"{result['step'] / reference:.2f}x",
            "peak memory growth": "-",
            "experts' weights, grads, AdamW": mib(stored * BYTES_PER_TRAINED_PARAM),
            "the rest": "-",
        })  # fmt: skip
    return rows


def label(implementation: str) -> str:
    """How the tables name an implementation of IMPLEMENTATIONS."""
    experts_implementation = IMPLEMENTATIONS[implementation]
    return f"{implementation} {experts_implementation}".strip()


def add_peak_memory(rows: list[dict[str, str]], args) -> None:
    """Fill in the scaling rows' peak memory, measured in processes of their own."""
    names = {label(implementation): implementation for implementation in IMPLEMENTATIONS}
    measurements = [(r["precision"], names[r["implementation"]], int(r["experts"])) for r in rows]
    for row, growth in zip(rows, peak_memory(measurements, args), strict=True):
        stored = expert_params(moe_config(args, int(row["experts"])))
        row["peak memory growth"] = mib(growth)
        row["the rest"] = mib(growth - stored * BYTES_PER_TRAINED_PARAM)


def mib(size: int) -> str:
    return f"{size / 2**20:,.0f} MiB"


def peak_memory(measurements: list[tuple[str, str, int]], args) -> list[int]:
    """For each (precision, implementation, experts): bytes the peak resident memory grows by
    over building that model and two training steps, each in a process of its own."""
    keys = ("batch_size", "seq_len", "vocab_size", "hidden_size", "layers", "top_k",
            "moe_intermediate_size")  # fmt: skip
    options = json.dumps({key: getattr(args, key) for key in keys})
    return in_fresh_process("bench_moe", f"peak_memory_here({measurements!r}, {options!r})")[
        "growth_bytes"
    ]


def peak_memory_here(measurements: list[tuple[str, str, int]], options: str) -> None:
    """`peak_memory`'s child: import once, then fork a process per measurement.

    A forked process starts from one that has imported the libraries and computed nothing
    (no freed memory to reuse, no thread pool started), so its growth is its model's alone.
    """
    if any(implementation != "ours" for _, implementation, _ in measurements):
        from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: F401  (before forks)

    args = argparse.Namespace(**json.loads(options))
    growth = []
    for precision, implementation, experts in measurements:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the measuring process: report through the pipe, never return
            os.close(read)
            code = 1
            try:
                os.write(write, str(growth_here(precision, implementation, experts, args)).encode())
                code = 0
            except BaseException:
                traceback.print_exc()  # os._exit skips Python's own report
                raise
            finally:
                os._exit(code)
        os.close(write)
        with os.fdopen(read) as pipe:
            reported = pipe.read()
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise RuntimeError(f"measuring {precision} {implementation} {experts} experts failed")
        growth.append(int(reported))
    print(json.dumps({"growth_bytes": growth}))


def status_kib(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM), in KiB."""
    return int(Path("/proc/self/status").read_text().split(f"{field}:")[1].split()[0])


def growth_here(precision: str, implementation: str, experts: int, args) -> int:
    """Reset this process's peak, build the model, train two steps: the peak's growth, bytes."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux 4.0 on)
    baseline = status_kib("VmRSS")
    config = moe_config(args, experts)
    torch.manual_seed(0)
    model, ids = build(implementation, config), batch_of(config.vocab_size, args)
    bf16, calls_transformers = precision == "bf16-mixed", implementation != "ours"
    Runner(model, ids, bf16, calls_transformers).timed(2)
    return (status_kib("VmHWM") - baseline) * 1024


def memory_measurable() -> bool:
    """Whether this OS resets and reports a process's peak memory (Linux)."""
    return Path("/proc/self/clear_refs").exists() and hasattr(os, "fork")


def warm_up_process(args) -> None:
    """One toy training step of each contender and precision, not timed: the process's
    one-off costs (thread pool, kernel libraries, transformers' lazy imports) then belong to
    no contender's cold start."""
    toy = argparse.Namespace(**{**vars(args), **QUICK, "experts": 4})
    config = moe_config(toy, 4)
    ids = batch_of(config.vocab_size, toy)
    for precision in args.precisions:
        bf16 = precision == "bf16-mixed"
        Runner(QwenLM(config), ids, bf16, calls_transformers=False).step()
        for experts_implementation in ("grouped_mm", "eager"):
            model = transformers_model(config, experts_implementation)
            Runner(model, ids, bf16, calls_transformers=True).step()


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, str]]]:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    args = parse_args(argv)
    config = moe_config(args, args.experts)
    total = QwenLM(config).num_parameters()
    warm_up_process(args)
    rows = [comparison(precision, args) for precision in args.precisions]
    scaling_rows = []
    if args.scaling_experts:
        scaling_rows = [row for p in args.precisions for row in scaling(p, args)]
        if not args.no_memory:
            add_peak_memory(scaling_rows, args)
    units = bf16_units()
    peak_size = 256 if args.quick else 2048
    command = "python scripts/bench_moe.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        machine_line(transformers=transformers.__version__),
        f"bf16 units: {units or 'none (bf16 would be emulated)'}; precisions measured: "
        f"{', '.join(args.precisions)}",
        f"Command: `{command.strip()}`",
        f"Model: Qwen3-MoE, {config.num_hidden_layers} layers, all sparse, hidden "
        f"{config.hidden_size}, {config.num_experts} experts (top-{config.num_experts_per_tok}, "
        f"moe_intermediate_size {config.moe_intermediate_size}, norm_topk_prob, no shared "
        f"expert), vocabulary {config.vocab_size}: {total / 1e6:.2f}M parameters, "
        f"{active_params(config, total) / 1e6:.2f}M active per token",
        f"Batch {args.batch_size} x {args.seq_len} tokens; loss = next-token cross-entropy + "
        f"{AUX_LOSS_COEF} x load-balancing loss; AdamW; a step is forward + backward + AdamW",
        f"Timing: first step apart (cold start), 2 warm-up steps, then {args.repeats} rounds of "
        f"{args.steps} steps, the contenders in turn (order rotated every round); medians",
        f"fp32 matmul peak of this CPU ({peak_size}² torch.mm): "
        f"{measure_matmul_flops(torch.float32, peak_size) / 1e9:,.0f} GFLOP/s",
        "",
        f"Training step, {config.num_experts} experts, ours vs transformers' Qwen3MoeForCausalLM "
        "(first-step loss of ours: "
        + ", ".join(f"{r['precision']} {r['first-step loss']}" for r in rows)
        + "):",
        "",
        markdown(rows, COLUMNS),
    ]
    if args.compile:
        lines += [
            "",
            f"The same rounds, under torch.compile ({args.compile}); compilation is the first "
            "step:",
            "",
            markdown(rows, COMPILED_COLUMNS),
        ]
    if scaling_rows:
        memory = (
            "not measured"
            if args.no_memory
            else "growth of the peak resident memory (VmHWM, reset before the model is built) "
            "over building it and two training steps, each in a process of its own"
        )
        lines += [
            "",
            f"Cost against the number of experts, top-{args.top_k} and moe_intermediate_size "
            f"{args.moe_intermediate_size} fixed (the same active parameters); peak memory: "
            f"{memory}; the rest: the growth less {BYTES_PER_TRAINED_PARAM} B per expert "
            "parameter:",
            "",
            markdown(scaling_rows, SCALING_COLUMNS),
        ]
    publish("\n".join(lines), args.output)
    failed = [r["precision"] for r in rows if r["numerics"] == "FAILED"]
    if failed:
        raise SystemExit(
            f"{', '.join(failed)}: the first step's losses of ours and transformers (or of the "
            f"compiled models) differ by {LOSS_TOLERANCE:.0e} or more"
        )
    return {"comparison": rows, "scaling": scaling_rows}


if __name__ == "__main__":
    exit_in_one_line(main)()
