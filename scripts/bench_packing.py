"""What packing buys: packed vs padded training throughput on long-tailed text.

    python scripts/bench_packing.py                       # SFT set + Shakespeare, dense + hybrid
    python scripts/bench_packing.py --quick               # seconds: tiny models, one round
    python scripts/bench_packing.py --output bench.md     # also write the Markdown section

For each dataset (the synthetic SFT set and Tiny Shakespeare's speeches, both long-tailed) the
same training documents are batched two ways by the datamodules themselves: packed into rows of
`max_seq_len` (best-fit decreasing, `--batch-size` rows per step) and padded to each batch's
longest (as many documents per step as a packed step holds on average, so both arms take the
same optimizer steps). Each arm trains its own copy of the same initial model (AdamW,
bf16-mixed autocast by default) on a fixed cycle of its batches; after a warm-up the two
alternate, `--repeats` rounds of `--steps` steps, order swapped every round, medians reported.

Non-padding tokens/s is the figure that matters: the padded arm spends compute on padding
slots. Cold start is reported apart: tokenising and packing the corpus with an empty cache and
with a warm one, and each arm's first step. The target: packed real tokens/s at least 0.9 x
(padded slots / real tokens) x the padded arm's. Speedups are against the padded arm.
"""

import argparse
import copy
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from benchmarks import machine_line, markdown, model_config, publish

from src.data.text.packed_text import PackedTextDataModule
from src.data.text.pretraining import TextDataModule
from src.data.text.sft import SFTDataModule
from src.models.language.qwen import QwenLM
from src.utils.contracts import IGNORE_INDEX
from src.utils.error_boundary import exit_in_one_line

ROOT = Path(__file__).resolve().parents[1]

SHAKESPEARE = ROOT / "src" / "data" / "assets" / "tinyshakespeare.txt"
DATASETS = ("sft", "shakespeare")
MODELS = {"dense": "qwen3_tiny", "hybrid": "qwen3_next_tiny"}
COLUMNS = (
    "data", "model", "arm", "docs/step", "padding", "real tok/s", "slot tok/s",
    "speedup (real tok/s)", "target", "first step",
)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round: seconds")
    parser.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS))
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8, help="packed rows per step")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per arm")
    parser.add_argument("--steps", type=int, default=4, help="training steps per round")
    parser.add_argument("--precision", choices=("fp32", "bf16-mixed"), default="bf16-mixed")
    parser.add_argument("--output", type=Path, help="write the Markdown section there too")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_seq_len, args.batch_size, args.repeats, args.steps = 64, 2, 1, 1
    return args


def datamodule(name: str, packing: bool, args, cache_dir: Path, batch_size: int, **options):
    options |= dict(
        max_seq_len=args.max_seq_len, packing=packing, batch_size=batch_size, cache_dir=cache_dir
    )
    if name == "sft":
        return SFTDataModule(synthetic_count=400 if args.quick else 4000, **options)
    return TextDataModule(paths=[str(SHAKESPEARE)], **options)


def timed_setup(
    name: str, args, cache_dir: Path, tokenizer: dict | None = None
) -> tuple[PackedTextDataModule, float]:
    module = datamodule(name, True, args, cache_dir, args.batch_size, tokenizer=tokenizer)
    start = time.perf_counter()
    module.setup()
    return module, time.perf_counter() - start


def cold_start(name: str, args, cache_dir: Path) -> tuple[PackedTextDataModule, str]:
    """The byte-level datamodule the arms train on, and the setup times (tokenise, pack) with
    an empty cache and from the cache, for bytes and for a BPE trained on the data."""
    module, empty = timed_setup(name, args, cache_dir)
    _, cached = timed_setup(name, args, cache_dir)
    bpe = {"kind": "bpe", "vocab_size": 1024}
    _, bpe_empty = timed_setup(name, args, cache_dir, bpe)
    _, bpe_cached = timed_setup(name, args, cache_dir, bpe)
    return module, (
        f"{name}: bytes {empty:.2f} s with an empty cache, {cached:.2f} s from it; BPE "
        f"(trained here, 1024 tokens) {bpe_empty:.2f} s, then {bpe_cached:.2f} s from the cache"
    )


def batches(module: PackedTextDataModule, count: int) -> list[dict]:
    """The first `count` training batches, collated by the datamodule's own loader."""
    loader = module.train_dataloader()
    return [batch for batch, _ in zip(loader, range(count), strict=False)]


class Arm:
    """One way of batching: a model copy, its optimizer, and a cycle of its batches."""

    def __init__(self, model: QwenLM, batches: list[dict], bf16: bool):
        self.model = model.train()
        self.batches = batches
        self.bf16 = bf16
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        self.next = 0
        self.real_tokens = self.slots = 0

    def step(self) -> None:
        batch = self.batches[self.next % len(self.batches)]
        self.next += 1
        with torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else nullcontext():
            logits = self.model(
                batch["input_ids"],
                position_ids=batch["position_ids"],
                cu_seqlens=batch["cu_seqlens"],
            )
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=IGNORE_INDEX
        )
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.real_tokens += int(batch["document_lengths"].sum())
        self.slots += batch["input_ids"].numel()

    def timed(self, steps: int) -> tuple[float, int, int]:
        """(seconds, real tokens, slots) of `steps` training steps."""
        real, slots = self.real_tokens, self.slots
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        return time.perf_counter() - start, self.real_tokens - real, self.slots - slots


def compare(dataset: str, kind: str, packed_module, args, cache_dir: Path) -> list[dict]:
    train_set = packed_module.datasets["train"]
    docs_per_row = len(train_set.samples) / len(train_set)
    padded_size = max(1, round(args.batch_size * docs_per_row))
    padded_modules = {
        "padded": datamodule(dataset, False, args, cache_dir, padded_size),
        "bucketed": datamodule(dataset, False, args, cache_dir, padded_size, bucket_by_length=True),
    }
    for module in padded_modules.values():
        module.setup()
    count = 2 + args.repeats * args.steps
    config = model_config(MODELS[kind], args.quick)
    config.vocab_size = max(config.vocab_size, packed_module.vocab_size)
    torch.manual_seed(0)
    model = QwenLM(config)
    bf16 = args.precision == "bf16-mixed"
    modules = {"packed": packed_module, **padded_modules}
    arms = {name: Arm(copy.deepcopy(model), batches(m, count), bf16) for name, m in modules.items()}
    first = {name: arm.timed(1)[0] for name, arm in arms.items()}
    for arm in arms.values():
        arm.timed(1)  # warm-up: oneDNN builds kernels per shape
    rounds = {name: [] for name in arms}
    order = list(arms)
    for _ in range(args.repeats):
        for name in order:
            rounds[name].append(arms[name].timed(args.steps))
        order.reverse()  # no arm always runs first or last
    rates = {}
    for name, measured in rounds.items():
        seconds = statistics.median(s for s, _, _ in measured)
        real = sum(r for _, r, _ in measured) / len(measured)
        slots = sum(s for _, _, s in measured) / len(measured)
        rates[name] = {"real": real / seconds, "slots": slots / seconds, "fill": real / slots}
    padded_waste = 1 / rates["padded"]["fill"]  # padded slots per real token
    target = 0.9 * padded_waste * rates["padded"]["real"]
    rows = []
    for name, rate in rates.items():
        size = docs_per_row * args.batch_size if name == "packed" else padded_size
        speedup = rate["real"] / rates["padded"]["real"]
        rows.append({
            "data": dataset,
            "model": f"{kind} ({MODELS[kind]})",
            "arm": name,
            "docs/step": f"{size:.0f}",
            "padding": f"{1 - rate['fill']:.1%}",
            "real tok/s": f"{rate['real']:,.0f}",
            "slot tok/s": f"{rate['slots']:,.0f}",
            "speedup (real tok/s)": f"{speedup:.2f}x",
            "target": (
                f"≥ {target / rates['padded']['real']:.2f}x: "
                f"{'met' if rate['real'] >= target else 'missed'}"
                if name == "packed"
                else ""
            ),
            "first step": f"{first[name]:.2f} s",
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, str]]:
    args = parse_args(argv)
    rows, cold = [], []
    with tempfile.TemporaryDirectory() as folder:
        cache_dir = Path(folder)
        for dataset in args.datasets:
            module, times = cold_start(dataset, args, cache_dir)
            cold.append(times)
            for kind in args.models:
                rows += compare(dataset, kind, module, args, cache_dir)
    command = "python scripts/bench_packing.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    report = "\n".join([
        machine_line(),
        f"{args.batch_size} packed rows of {args.max_seq_len} tokens per step, {args.precision}; "
        f"{args.steps} steps per round, median of {args.repeats} rounds; "
        f"command: `{command.strip()}`",
        "",
        markdown(rows, COLUMNS),
        "",
        "Cold start, tokenising and packing: " + "; ".join(cold),
    ])  # fmt: skip
    publish(report, args.output)
    return rows


if __name__ == "__main__":
    exit_in_one_line(main)()
