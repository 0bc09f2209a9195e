"""What the token store costs: preparing corpora of growing size, and training from them.

    python scripts/bench_data.py                        # 10 and 100 MB, bytes and a BPE
    python scripts/bench_data.py --sizes 10,100,1000    # and 1 GB (minutes, a few GB of disk)
    python scripts/bench_data.py --output bench.md      # also write the Markdown section
    python scripts/bench_data.py --streaming            # data.streaming=true from Parquet shards

A corpus of Shakespeare-like documents (runs of Tiny Shakespeare's speeches, a long-tailed
number per document) is generated at each size. For each size and tokenizer (bytes, and a
BPE trained once on Tiny Shakespeare and read from its folder), each measurement runs in a
child process of its own, so that peak RSS (the child's and its tokenising workers') is its
alone:

- prepare: `TextDataModule.setup()` with an empty cache: read, tokenise (`num_proc`
  processes), write the store, pack;
- train: a second `setup()` (the store is found) and a tiny Qwen LM's training steps on its
  batches: the setup's time, the time from its start to the end of the first step, then real
  (non-padding) tokens/s of the training loader alone and of training;
- anchor: `datasets.load_dataset("text").map(tokenize, batched=True, num_proc)` with the same
  tokenizer and an empty cache.

With `--streaming`, each corpus is written as Parquet shards and one child measures
`data.streaming=true` on them with bytes: the time from `setup()` to the first batch, real
tokens/s of the training loader, and its memory.

RSS columns: the peak, how far above the baseline the imports left (torch, Lightning and
`datasets` take about 0.9 GB), and the largest child process's peak; "anon" columns: the rise
of anonymous memory alone (see `PeakAnonymous`).
"""

import argparse
import json
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from src.utils.error_boundary import exit_in_one_line

ROOT = Path(__file__).resolve().parents[1]

SHAKESPEARE = ROOT / "src" / "data" / "assets" / "tinyshakespeare.txt"
COLUMNS = (
    "size", "tokenizer", "prepare s", "MB/s", "prepare RSS", "prepare anon", "anchor s",
    "anchor RSS", "2nd run: setup", "first step", "train RSS", "train anon", "loader tok/s",
    "train tok/s",
)  # fmt: skip
STREAM_COLUMNS = ("size", "shards", "first batch", "loader tok/s", "RSS", "anon")
SHARDS = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,100", help="corpus sizes in MB, comma-separated")
    parser.add_argument("--tokenizers", default="byte,bpe")
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed training steps")
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temporary one")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--streaming", action="store_true", help="measure data.streaming=true")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def make_corpus(path: Path, megabytes: float, seed: int = 0) -> None:
    """Documents of 1 to ~200 consecutive speeches (Pareto-distributed), blank-line separated."""
    speeches = SHAKESPEARE.read_text().split("\n\n")
    rng, written = random.Random(seed), 0
    with path.open("w") as file:
        while written < megabytes * 1e6:
            count = min(200, int(rng.paretovariate(1.3)))
            start = rng.randrange(len(speeches) - count)
            document = " ".join(s.replace("\n", " ") for s in speeches[start : start + count])
            written += file.write(document + "\n\n")


def write_shards(corpus: Path, folder: Path, shards: int = SHARDS) -> list[Path]:
    """The documents of `corpus` (one a line) dealt out to `shards` Parquet files in turn."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"part-{shard:02d}.parquet" for shard in range(shards)]
    writers = [pq.ParquetWriter(path, pa.schema([("text", pa.string())])) for path in paths]
    buffers: list[list[str]] = [[] for _ in paths]
    with corpus.open() as file:
        for number, line in enumerate(line for line in file if line.strip()):
            buffer = buffers[number % shards]
            buffer.append(line.strip())
            if len(buffer) == 10_000:
                writers[number % shards].write_table(pa.table({"text": buffer}))
                buffer.clear()
    for writer, buffer in zip(writers, buffers, strict=True):
        writer.write_table(pa.table({"text": buffer}))
        writer.close()
    return paths


def train_bpe(folder: Path) -> None:
    from src.data.corpus.tokenizers import train_bpe as train

    train(lambda: iter(SHAKESPEARE.read_text().split("\n\n")), 2048).save(folder)


def peak_rss_mb() -> dict[str, float]:
    """Peak resident memory of this process and of its largest child (a tokenising worker),
    apart: a forked child's RSS counts the pages it still shares with this process."""
    usage = {"rss": resource.RUSAGE_SELF, "worker_rss": resource.RUSAGE_CHILDREN}
    return {key: resource.getrusage(who).ru_maxrss / 1024 for key, who in usage.items()}  # KiB


def rss_mb(field: str = "VmRSS") -> float:
    """This process's resident memory now (`RssAnon`: what is not a mapped file's pages)."""
    status = Path("/proc/self/status").read_text()
    return int(status.split(f"{field}:")[1].split()[0]) / 1024


class PeakAnonymous(threading.Thread):
    """Samples this process's anonymous resident memory every 20 ms and keeps the largest.

    Peak RSS also counts the pages of memory-mapped files that have been read (the Arrow
    files `datasets` maps, the token store): the kernel drops those clean pages when memory
    runs short, so they are reported apart from the memory the process owns.
    """

    def __init__(self):
        super().__init__(daemon=True)
        self.base = self.peak = rss_mb("RssAnon")

    def run(self) -> None:
        while True:
            self.peak = max(self.peak, rss_mb("RssAnon"))
            time.sleep(0.02)


def child(spec: dict) -> dict:
    """One measurement, in this process alone; see the module docstring."""
    tokenizer = {"kind": "byte"} if spec["tokenizer"] == "byte" else spec["bpe"]
    if spec["what"] == "anchor":
        return anchor(spec, tokenizer)
    if spec["what"] == "stream":
        return stream(spec)
    from src.data.text.pretraining import TextDataModule

    def module():
        return TextDataModule(
            paths=[spec["corpus"]],
            cache_dir=spec["cache"],
            num_proc=spec["num_proc"],
            tokenizer=tokenizer,
            max_seq_len=256,
            batch_size=8,
            shuffle_seed=0,
        )

    # What training imports, imported before the baseline and the clock.
    import torch  # noqa: F401
    from benchmarks import model_config  # noqa: F401

    from src.models.language.qwen import QwenLM  # noqa: F401

    base, anonymous = rss_mb(), PeakAnonymous()
    anonymous.start()
    started = time.perf_counter()
    data = module()
    data.setup()
    seconds = time.perf_counter() - started
    if spec["what"] == "prepare":
        result = {"seconds": seconds, **peak_rss_mb()}
    else:
        result = {"setup": seconds, **train(data, started, spec["steps"])}
    return {**result, "base": base, "anon_base": anonymous.base, "anon_peak": anonymous.peak}


def train(data, started: float, steps: int) -> dict:
    import torch
    from benchmarks import model_config

    from src.models.language.qwen import QwenLM

    torch.manual_seed(0)
    config = model_config("qwen3_tiny", quick=True)
    config.vocab_size = max(config.vocab_size, data.tokenizer.vocab_size)
    model = QwenLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = iter(data.train_dataloader())

    def step() -> int:
        batch = next(batches)
        logits = model(
            batch["input_ids"], position_ids=batch["position_ids"], cu_seqlens=batch["cu_seqlens"]
        )
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return int(batch["document_lengths"].sum())

    step()
    first_step = time.perf_counter() - started
    step()  # warm-up
    timed, tokens = time.perf_counter(), 0
    for _ in range(steps):
        tokens += step()
    seconds = time.perf_counter() - timed
    return {
        "first_step": first_step,
        "tokens_per_s": tokens / seconds,
        "loader_tokens_per_s": loader_rate(data),
        **peak_rss_mb(),
    }


def loader_rate(data, batches: int = 300) -> float:
    """Real tokens/s of the training loader alone: rows read from the store and collated."""
    started, tokens = time.perf_counter(), 0
    for _, batch in zip(range(batches), data.train_dataloader(), strict=False):
        tokens += int(batch["document_lengths"].sum())
    return tokens / (time.perf_counter() - started)


def stream(spec: dict) -> dict:
    """`data.streaming=true` over the shards: time to the first batch, then the loader alone."""
    from src.data.text.pretraining import TextDataModule

    base, anonymous = rss_mb(), PeakAnonymous()
    anonymous.start()
    started = time.perf_counter()
    data = TextDataModule(
        paths=spec["shards"], val_paths=[spec["heldout"]], streaming=True,
        cache_dir=spec["cache"], max_seq_len=256, batch_size=8, shuffle_seed=0,
    )  # fmt: skip
    data.setup()
    batches = iter(data.train_dataloader())
    next(batches)
    first_batch = time.perf_counter() - started
    timed, tokens = time.perf_counter(), 0
    for _, batch in zip(range(300), batches, strict=False):
        tokens += int(batch["document_lengths"].sum())
    rate = tokens / (time.perf_counter() - timed)
    return {
        "first_batch": first_batch, "tokens_per_s": rate, **peak_rss_mb(), "base": base,
        "anon_base": anonymous.base, "anon_peak": anonymous.peak,
    }  # fmt: skip


def run_streaming(args: argparse.Namespace, work: Path) -> list[dict[str, str]]:
    """Each size's shards streamed, validated on the same 1 MB of held-out documents."""
    make_corpus(work / "heldout.txt", 1, seed=1)
    (heldout,) = write_shards(work / "heldout.txt", work / "heldout", shards=1)
    rows = []
    for size in [float(s) for s in args.sizes.split(",")]:
        corpus = work / f"corpus-{size:g}MB.txt"
        make_corpus(corpus, size)
        megabytes = corpus.stat().st_size / 1e6
        shards = write_shards(corpus, work / f"shards-{size:g}")
        corpus.unlink()
        spec = {
            "what": "stream", "shards": [str(p) for p in shards], "heldout": str(heldout),
            "cache": str(work / "cache"),
        }  # fmt: skip
        result = measure({**spec, "tokenizer": "byte"})
        shutil.rmtree(work / f"shards-{size:g}")
        rows.append(
            {
                "size": size_label(megabytes),
                "shards": str(len(shards)),
                "first batch": f"{result['first_batch']:.2f} s",
                "loader tok/s": f"{result['tokens_per_s']:,.0f}",
                "RSS": rss(result),
                "anon": anonymous(result),
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def anchor(spec: dict, tokenizer: dict) -> dict:
    import datasets
    from tokenizers import Tokenizer

    datasets.disable_progress_bars()
    if tokenizer["kind"] == "byte":

        def tokenize(batch):
            return {"input_ids": [[*text.encode(), 256] for text in batch["text"]]}
    else:
        bpe = Tokenizer.from_file(str(Path(tokenizer["path"]) / "tokenizer.json"))

        def tokenize(batch):
            encoded = bpe.encode_batch_fast(batch["text"], add_special_tokens=False)
            return {"input_ids": [e.ids for e in encoded]}

    base = rss_mb()
    started = time.perf_counter()
    corpus = datasets.load_dataset(
        "text", data_files=spec["corpus"], sample_by="paragraph", split="train",
        cache_dir=spec["cache"],
    )  # fmt: skip
    corpus.map(tokenize, batched=True, num_proc=spec["num_proc"], remove_columns=["text"])
    return {"seconds": time.perf_counter() - started, **peak_rss_mb(), "base": base}


def measure(spec: dict) -> dict:
    command = [sys.executable, __file__, "--child", json.dumps(spec)]
    result = subprocess.run(command, capture_output=True, text=True, check=False, cwd=ROOT)
    if result.returncode:
        raise SystemExit(f"{spec['what']} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def size_label(megabytes: float) -> str:
    return f"{megabytes / 1000:.3g} GB" if megabytes >= 1000 else f"{megabytes:.3g} MB"


def rss(result: dict) -> str:
    """Peak RSS, in brackets how far above the baseline its imports left, then the largest
    worker's peak (when there were workers)."""
    text = f"{result['rss']:.0f} MB (+{result['rss'] - result['base']:.0f})"
    return text + (f" / {result['worker_rss']:.0f} MB" if result["worker_rss"] else "")


def anonymous(result: dict) -> str:
    """How far the peak anonymous memory rose above the baseline its imports left."""
    return f"+{result['anon_peak'] - result['anon_base']:.0f} MB"


def run(args: argparse.Namespace, work: Path) -> list[dict[str, str]]:
    bpe = work / "bpe"
    train_bpe(bpe)
    rows = []
    for size in [float(s) for s in args.sizes.split(",")]:
        corpus = work / f"corpus-{size:g}MB.txt"
        make_corpus(corpus, size)
        megabytes = corpus.stat().st_size / 1e6
        for name in args.tokenizers.split(","):
            spec = {
                "corpus": str(corpus), "tokenizer": name, "num_proc": args.num_proc,
                "bpe": {"kind": "pretrained", "path": str(bpe)}, "steps": args.steps,
            }  # fmt: skip
            cache = work / f"cache-{size:g}-{name}"
            results = {}
            for what in ("anchor", "prepare", "train"):
                if what != "train":
                    shutil.rmtree(cache, ignore_errors=True)
                results[what] = measure({**spec, "what": what, "cache": str(cache)})
            shutil.rmtree(cache, ignore_errors=True)
            prepare, anchor_run, trained = results["prepare"], results["anchor"], results["train"]
            rows.append(
                {
                    "size": size_label(megabytes),
                    "tokenizer": name,
                    "prepare s": f"{prepare['seconds']:.1f}",
                    "MB/s": f"{megabytes / prepare['seconds']:.1f}",
                    "prepare RSS": rss(prepare),
                    "prepare anon": anonymous(prepare),
                    "anchor s": f"{anchor_run['seconds']:.1f}",
                    "anchor RSS": rss(anchor_run),
                    "2nd run: setup": f"{trained['setup']:.2f} s",
                    "first step": f"{trained['first_step']:.2f} s",
                    "train RSS": rss(trained),
                    "train anon": anonymous(trained),
                    "loader tok/s": f"{trained['loader_tokens_per_s']:,.0f}",
                    "train tok/s": f"{trained['tokens_per_s']:,.0f}",
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr)
        corpus.unlink()
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, str]]:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return []
    from benchmarks import machine_line, markdown, publish

    measure_all, columns = (run_streaming, STREAM_COLUMNS) if args.streaming else (run, COLUMNS)
    if args.work_dir:
        args.work_dir.mkdir(parents=True, exist_ok=True)
        rows = measure_all(args, args.work_dir)
    else:
        with tempfile.TemporaryDirectory() as work:
            rows = measure_all(args, Path(work))
    import datasets

    report = "\n\n".join([machine_line(datasets=datasets.__version__), markdown(rows, columns)])
    publish(report, args.output)
    return rows


if __name__ == "__main__":
    exit_in_one_line(main)()
