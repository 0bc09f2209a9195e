"""Benchmarks against the references, interleaved in one process so machine drift cancels out.

1. trainer: a hand-written PyTorch loop vs this template's Trainer (default callbacks and
   logger, progress bar off as in a batch job), same network, data, batch size and steps.
2. data: one epoch of per-sample torchvision transforms vs this template's default image path
   (deterministic transforms computed once per split).
3. compile: the hand-written loop on the CNN, eager vs `torch.compile`, compile time apart.
4. ddp (only when asked for): train.py in one process vs two DDP processes over gloo
   (trainer=ddp_cpu) on the same global batch, one torch thread per process, so that the
   comparison is per core; plus one process on the per-process batch, whose step time is the
   DDP step's without the strategy. Reports the scaling efficiency, two processes' samples/s
   over twice one's, and the strategy's overhead per step.
5. fsdp (only when asked for; needs a CUDA GPU): the Qwen3-0.6B config on one GPU, packed
   text, trainer=ddp vs trainer=fsdp, and FSDP recomputing each decoder layer's activations:
   tokens/s and peak GPU memory. On one GPU FSDP has nothing to shard across and runs
   NO_SHARD, so this measures its wrapping, precision and recomputation costs, not sharding.
   One run per arm by default (about 3 minutes on an H200); `--lm-repeats 3` for medians.
6. startup (only when asked for): wall time of fresh processes, `python -c "import lightning"`
   vs `python train.py --help` and vs a one-epoch digits run (`train.py trainer.max_epochs=1`):
   what the template adds to the import every run pays anyway. The first run of each arm is
   the cold start (files not yet in the OS cache, if the machine was idle), the medians are
   over the later runs.

Each case alternates its arms `--repeats` times and reports medians of steady-state rates
(warm-up steps excluded); cold start is reported separately. Usage:

    python scripts/bench.py                 # trainer, data, compile; writes logs/bench/bench.json
    python scripts/bench.py --cases ddp     # the DDP case alone (needs 2 idle cores)
    python scripts/bench.py --cases fsdp    # on a GPU machine
    python scripts/bench.py --cases startup # about 2.5 minutes on 2 cores
    python scripts/bench.py --quick         # seconds; checks the machinery, not the speed
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import cycle
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from benchmarks import machine
from torch.utils.data import DataLoader, TensorDataset
from torchvision.transforms import v2

from src.data.image.datamodule import TransformedDataset, precompute
from src.models.vision.cnn import CNN
from src.models.vision.simplenet import SimpleNet
from src.run.config.checks import check_config_types
from src.run.config.compose import compose_run_config
from src.utils.error_boundary import exit_in_one_line

ROOT = Path(__file__).resolve().parents[1]

NETWORKS = {"simplenet": SimpleNet, "cnn": CNN}
MNIST_TRANSFORM = v2.Compose(
    [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean=[0.1307], std=[0.3081])]
)


def mnist_like(n: int, seed: int = 0) -> TensorDataset:
    """Random uint8 28x28 images and labels: the shapes and dtypes of raw MNIST."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 1, 28, 28), dtype=torch.uint8, generator=generator)
    return TensorDataset(images, torch.randint(0, 10, (n,), generator=generator))


# -- 1. hand-written loop vs the template's Trainer -------------------------------------------


def hand_loop(
    network: str, loader: DataLoader, warmup: int, steps: int, compile_net: bool = False
) -> dict[str, float]:
    """The classic loop: forward, loss, zero_grad, backward, step. Returns steady steps/s."""
    torch.manual_seed(0)
    net = NETWORKS[network](input_shape=[1, 28, 28], num_classes=10)
    if compile_net:
        net.compile()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    batches = cycle(loader)
    start = time.perf_counter()
    first_step = None
    for step in range(warmup + steps):
        if step == warmup:
            steady_start = time.perf_counter()
        inputs, targets = next(batches)
        loss = F.cross_entropy(net(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if first_step is None:
            first_step = time.perf_counter() - start
    return {"steps_per_s": steps / (time.perf_counter() - steady_start), "first_step_s": first_step}


def trainer_overrides(
    network: str, data_path: Path, batch_size: int, warmup: int, steps: int
) -> list[str]:
    """train.py's overrides for `warmup + steps` training steps on the saved MNIST-like arrays,
    without validation, test, progress bar or model summary."""
    return [
        f"model={'simplenet' if network == 'simplenet' else 'cnn'}",
        "data=tensors",
        f"data.path={data_path}",
        "data.num_classes=10",
        "data.input_shape=[1,28,28]",
        "data.val_fraction=0.01",
        "data.test_fraction=0.01",
        "data.transform=null",
        f"data.batch_size={batch_size}",
        f"trainer.max_steps={warmup + steps}",
        "trainer.max_epochs=null",
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
        "trainer.enable_progress_bar=false",
        "callbacks.rich_progress_bar=null",
        "callbacks.model_summary=null",
        f"callbacks.throughput.warmup_steps={warmup}",
        "test=false",
        "trainer.accelerator=cpu",
    ]


def template_trainer(
    network: str, data_path: Path, run_dir: Path, batch_size: int, warmup: int, steps: int
) -> dict[str, float]:
    """train.py's own code path on the same data; steady steps/s from the Throughput callback."""
    from train import train

    overrides = trainer_overrides(network, data_path, batch_size, warmup, steps)
    metrics = train(compose_run_config(run_dir, overrides))["metrics"]
    return {
        "steps_per_s": metrics["perf/steps_per_s"],
        "first_step_s": metrics["perf/time_to_first_step_s"],
    }


def write_mnist_like(work: Path, n: int) -> tuple[Path, TensorDataset]:
    """MNIST-like images with the transforms precomputed, saved for data=tensors."""
    images = precompute(mnist_like(n), MNIST_TRANSFORM)
    data_path = work / "mnist_like.npz"
    x, y = images.tensors
    np.savez(data_path, x=x.numpy(), y=y.numpy())
    return data_path, images


def bench_trainer(args, work: Path) -> list[dict]:
    n = args.batch_size * (args.warmup + args.steps) * 2  # never ends an epoch mid-measurement
    data_path, images = write_mnist_like(work, n)
    loader = DataLoader(images, batch_size=args.batch_size, shuffle=True)
    rows = []
    for network in ("simplenet", "cnn"):
        arms = {"hand-written loop": [], "template Trainer": []}
        for repeat in range(args.repeats):
            arms["hand-written loop"].append(hand_loop(network, loader, args.warmup, args.steps))
            arms["template Trainer"].append(
                template_trainer(
                    network,
                    data_path,
                    work / f"{network}_{repeat}",
                    args.batch_size,
                    args.warmup,
                    args.steps,
                )
            )
        rows.append(
            compare(f"trainer/{network}", "steps/s", arms, "hand-written loop", "template Trainer")
        )
    return rows


# -- 2. data pipeline ----------------------------------------------------------------------


def epoch_time(loader: DataLoader) -> float:
    start = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - start


def bench_data(args) -> list[dict]:
    raw = mnist_like(args.data_samples)
    per_sample = DataLoader(
        TransformedDataset(raw, MNIST_TRANSFORM), batch_size=args.batch_size, shuffle=True
    )
    arms = {"per-sample transforms": [], "template default": []}
    cold = []
    for _ in range(args.repeats):
        arms["per-sample transforms"].append({"epochs_per_s": 1 / epoch_time(per_sample)})
        start = time.perf_counter()
        precomputed = precompute(raw, MNIST_TRANSFORM)  # once per split, at set-up
        cold.append(time.perf_counter() - start)
        loader = DataLoader(precomputed, batch_size=args.batch_size, shuffle=True)
        arms["template default"].append({"epochs_per_s": 1 / epoch_time(loader)})
    row = compare("data/mnist-like", "epochs/s", arms, "per-sample transforms", "template default")
    row["cold_start_s"] = {"template default": statistics.median(cold)}  # the precompute
    return [row]


# -- 3. eager vs compiled --------------------------------------------------------------------


def bench_compile(args) -> list[dict]:
    images = precompute(mnist_like(args.batch_size * 8), MNIST_TRANSFORM)
    loader = DataLoader(images, batch_size=args.batch_size, shuffle=True, drop_last=True)
    arms = {"eager": [], "compiled": []}
    for _ in range(args.repeats):
        arms["eager"].append(hand_loop("cnn", loader, args.warmup, args.steps))
        torch._dynamo.reset()  # every repeat pays its own compilation
        arms["compiled"].append(hand_loop("cnn", loader, args.warmup, args.steps, True))
    return [compare("compile/cnn", "steps/s", arms, "eager", "compiled")]


# -- 4. DDP on CPU: two processes vs one ------------------------------------------------------


def train_process(overrides: list[str], run_dir: Path, threads: int | None = None) -> dict:
    """train.py in its own process (plain ddp re-runs the command line, so it cannot run in
    this one), with `threads` torch threads; rank 0's metrics from metrics.json."""
    command = [sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={run_dir}"]
    environment = os.environ | ({} if threads is None else {"OMP_NUM_THREADS": str(threads)})
    process = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True)
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{process.stderr[-3000:]}")
    return json.loads((run_dir / "metrics.json").read_text())["metrics"]


def template_process(overrides: list[str], run_dir: Path, batch_size: int) -> dict[str, float]:
    """One torch thread per process; steady rates of the global batch."""
    metrics = train_process(overrides, run_dir, threads=1)
    steps_per_s = metrics["perf/steps_per_s"]
    return {
        "samples_per_s": steps_per_s * batch_size,
        "first_step_s": metrics["perf/time_to_first_step_s"],
        "ms_per_step": 1000 / steps_per_s,
    }


def bench_ddp(args, work: Path) -> list[dict]:
    batch, half = args.batch_size, args.batch_size // 2
    data_path, _ = write_mnist_like(work, batch * (args.warmup + args.steps) * 2)
    one, two, one_half = (
        f"1 process, batch {batch}",
        f"2 processes x batch {half}",
        f"1 process, batch {half}",
    )
    arms = {  # per-process batch, global batch, strategy overrides
        one: (batch, batch, []),
        two: (half, batch, ["trainer=ddp_cpu"]),
        one_half: (half, half, []),
    }
    rows = []
    for network in ("simplenet",) if args.quick else ("simplenet", "cnn"):
        runs = {arm: [] for arm in arms}
        for repeat in range(args.repeats):
            for index, (arm, (per_process, global_batch, strategy)) in enumerate(arms.items()):
                overrides = trainer_overrides(
                    network, data_path, per_process, args.warmup, args.steps
                )
                run_dir = work / f"ddp_{network}_{repeat}_{index}"
                runs[arm].append(template_process([*overrides, *strategy], run_dir, global_batch))
        row = compare(f"ddp/{network}", "samples/s", runs, one, two)
        ms_per_step = {
            arm: statistics.median(r["ms_per_step"] for r in rs) for arm, rs in runs.items()
        }
        row["ms_per_step"] = ms_per_step
        row["scaling_efficiency"] = row["ratio"] / 2
        row["overhead_ms_per_step"] = ms_per_step[two] - ms_per_step[one_half]
        row["threads_per_process"] = 1
        rows.append(row)
    return rows


# -- 5. FSDP vs DDP on one GPU, the 0.6B LM --------------------------------------------------

RECOMPUTE = "model.activation_checkpointing=true"
FSDP_ARMS = {
    "ddp": ["trainer=ddp"],
    "fsdp": ["trainer=fsdp"],
    "fsdp, recomputed activations": ["trainer=fsdp", RECOMPUTE],
}


FSDP_ONE_DEVICE_NOTE = (
    "one device: FSDP runs NO_SHARD (FULL_SHARD needs 2+ GPUs), so fsdp vs ddp measures "
    "FSDP's wrapping, bf16 parameters and recomputation, not sharding"
)


def lm_overrides(model: str, batch_size: int, seq_len: int, warmup: int, steps: int) -> list[str]:
    """train.py's overrides for `warmup + steps` steps of the packed-text LM on one device,
    without validation, test or checkpoints (a 0.6B checkpoint takes longer than the steps)."""
    return [
        "experiment=lm_text",
        f"model={model}",
        f"data.batch_size={batch_size}",
        f"data.max_seq_len={seq_len}",
        "trainer.devices=1",
        f"trainer.max_steps={warmup + steps}",
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
        "trainer.enable_progress_bar=false",
        "callbacks.rich_progress_bar=null",
        "callbacks.model_checkpoint=null",
        "callbacks.last_checkpoint=null",
        f"callbacks.throughput.warmup_steps={warmup}",
        "logger=csv",
        "test=false",
    ]


def bench_fsdp(args, work: Path) -> list[dict]:
    overrides = lm_overrides(
        "qwen3_0_6b", args.lm_batch_size, args.seq_len, args.warmup, args.lm_steps
    )
    # Every arm's config composes and type-checks before the first run: a mistake in the last
    # arm must not wait for the GPU runs of the others.
    for index, strategy in enumerate(FSDP_ARMS.values()):
        check_config_types(
            compose_run_config(work / f"fsdp_config_{index}", [*overrides, *strategy])
        )
    if not torch.cuda.is_available():
        raise SystemExit("The fsdp case needs a CUDA GPU (Lightning runs FSDP on CUDA only).")
    runs = {arm: [] for arm in FSDP_ARMS}
    for repeat in range(args.lm_repeats):
        for index, (arm, strategy) in enumerate(FSDP_ARMS.items()):
            metrics = train_process([*overrides, *strategy], work / f"fsdp_{repeat}_{index}")
            runs[arm].append(
                {
                    "tokens_per_s": metrics["perf/tokens_per_s"],
                    "first_step_s": metrics["perf/time_to_first_step_s"],
                    "peak_memory_gib": metrics["perf/peak_memory_gib"],
                }
            )
    row = compare("fsdp/qwen3_0_6b", "tok/s", runs, "ddp", "fsdp")
    row["peak_memory_gib"] = {
        arm: max(r["peak_memory_gib"] for r in rs) for arm, rs in runs.items()
    }
    row["tokens_per_step"] = args.lm_batch_size * args.seq_len
    row["note"] = FSDP_ONE_DEVICE_NOTE
    return [row]


# -- 6. start-up: import lightning vs train.py --help vs a one-epoch digits run ---------------

IMPORT_LIGHTNING, DIGITS = "import lightning", "digits, 1 epoch"
STARTUP_ARMS = {  # arm: the arguments of `python`
    IMPORT_LIGHTNING: ["-c", "import lightning"],
    "train.py --help": ["train.py", "--help"],
    DIGITS: ["train.py", "trainer.max_epochs=1"],
}


def process_seconds(arguments: list[str], log_dir: Path) -> float:
    """Wall time of `python <arguments>` in a fresh process, from spawn to exit."""
    command = [sys.executable, *arguments]
    environment = os.environ | {"PROJECT_LOG_DIR": str(log_dir)}
    start = time.perf_counter()
    process = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{process.stderr[-3000:]}")
    return seconds


def bench_startup(args, work: Path) -> list[dict]:
    """Each arm `--startup-repeats` times, interleaved; the first round is the cold start, the
    medians are over the later rounds (over the only one with `--quick`). Here the ratio is of
    times, not rates: the arm's seconds over the import's, lower is better."""
    runs: dict[str, list[float]] = {arm: [] for arm in STARTUP_ARMS}
    for repeat in range(args.startup_repeats):
        for index, (arm, arguments) in enumerate(STARTUP_ARMS.items()):
            runs[arm].append(process_seconds(arguments, work / f"startup_{repeat}_{index}"))
    rows = []
    for case, candidate in [("startup/--help", "train.py --help"), ("startup/digits", DIGITS)]:
        arms = {arm: runs[arm] for arm in (IMPORT_LIGHTNING, candidate)}
        steady = {arm: seconds[1:] or seconds for arm, seconds in arms.items()}
        medians = {arm: statistics.median(seconds) for arm, seconds in steady.items()}
        rows.append(
            {
                "case": case,
                "unit": "s",
                "medians": medians,
                "ratio": medians[candidate] / medians[IMPORT_LIGHTNING],
                "reference": IMPORT_LIGHTNING,
                "candidate": candidate,
                "runs": arms,
                "cold_start_s": {arm: seconds[0] for arm, seconds in arms.items()},
            }
        )
    return rows


# -- reporting -------------------------------------------------------------------------------


def compare(
    case: str, unit: str, arms: dict[str, list[dict]], reference: str, candidate: str
) -> dict:
    """Medians of each arm's steady rate, the ratio candidate/reference, and cold starts."""
    rate_key = next(iter(arms[reference][0]))
    medians = {arm: statistics.median(run[rate_key] for run in runs) for arm, runs in arms.items()}
    row = {
        "case": case,
        "unit": unit,
        "medians": medians,
        "ratio": medians[candidate] / medians[reference],
        "reference": reference,
        "candidate": candidate,
        "runs": {arm: [run[rate_key] for run in runs] for arm, runs in arms.items()},
    }
    first_steps = {
        arm: statistics.median(r["first_step_s"] for r in runs)
        for arm, runs in arms.items()
        if "first_step_s" in runs[0]
    }
    if first_steps:
        row["cold_start_s"] = first_steps
    return row


def print_table(rows: list[dict]) -> None:
    print(f"\n{'case':<18} {'arm':<24} {'median':>16} {'cold start':>11} {'ratio':>7}")
    for row in rows:
        others = [arm for arm in row["medians"] if arm not in (row["reference"], row["candidate"])]
        for arm in (row["reference"], row["candidate"], *others):
            cold = row.get("cold_start_s", {}).get(arm)
            ratio = f"{row['ratio']:.2f}x" if arm == row["candidate"] else ""
            median = f"{row['medians'][arm]:>9.{2 if row['unit'] == 's' else 1}f}"
            print(
                f"{row['case'] if arm == row['reference'] else '':<18} {arm:<24} "
                f"{median} {row['unit']:<6} "
                f"{'' if cold is None else f'{cold:.3f} s':>11} {ratio:>7}"
            )
        if "peak_memory_gib" in row:
            memory = ", ".join(f"{arm} {gib:.1f}" for arm, gib in row["peak_memory_gib"].items())
            print(f"{'':<18} peak GPU memory (GiB): {memory}")
        if "note" in row:
            print(f"{'':<18} {row['note']}")
        if "scaling_efficiency" in row:
            print(
                f"{'':<18} scaling efficiency {row['scaling_efficiency']:.0%} per core, "
                f"DDP overhead {row['overhead_ms_per_step']:.2f} ms/step"
            )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks, not timings")
    parser.add_argument("--cases", default="trainer,data,compile", help="and/or ddp, fsdp, startup")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--data-samples", type=int, default=10_000)
    parser.add_argument("--lm-batch-size", type=int, default=8, help="fsdp: rows per step")
    parser.add_argument("--seq-len", type=int, default=2048, help="fsdp: tokens per row")
    parser.add_argument("--lm-steps", type=int, default=30, help="fsdp: timed steps per run")
    parser.add_argument("--lm-repeats", type=int, default=1, help="fsdp: runs per arm")
    parser.add_argument(
        "--startup-repeats", type=int, default=6, help="startup: rounds, the first one cold"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "logs" / "bench" / "bench.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup, args.steps, args.repeats, args.data_samples = 2, 4, 1, 256
        args.lm_batch_size, args.seq_len, args.lm_steps = 2, 128, 4
        args.startup_repeats = 1
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    cases = {
        "trainer": bench_trainer,
        "data": lambda a, _: bench_data(a),
        "compile": lambda a, _: bench_compile(a),
        "ddp": bench_ddp,
        "fsdp": bench_fsdp,
        "startup": bench_startup,
    }
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for case in args.cases.split(","):
            rows += cases[case](args, Path(work))
    print_table(rows)
    result = {
        "command": " ".join(["python", "scripts/bench.py", *(argv or sys.argv[1:])]),
        "machine": machine(),
        "settings": vars(args) | {"out": str(args.out)},
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nWrote {args.out}")
    return rows


if __name__ == "__main__":
    exit_in_one_line(main)()
