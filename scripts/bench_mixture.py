"""What a weighted data mixture (`data.mixture`) costs next to one source, as the data grows.

    python scripts/bench_mixture.py                    # 10^5 to 10^7 rows; 1 and 10 MB corpora
    python scripts/bench_mixture.py --quick            # seconds: the machinery only
    python scripts/bench_mixture.py --output bench.md  # also write the Markdown section

Three measurements, each against the one-source reference on the same rows:

- epoch draw: building an epoch's order of `rows` training rows, what a sampler does when an
  epoch starts (`ResumableDistributedSampler` over one source against `MixtureSampler` over
  three sources weighted 0.5/0.3/0.2 of the same rows), median of `--repeats`;
- stored loader: training rows/s of the datamodule's training loader (collated batches of
  256-byte rows) on a corpus of Shakespeare-like documents, one source against the same
  documents as three weighted sources, the two interleaved `--repeats` times, medians; the
  setup (tokenising, packing) is reported apart, with an empty cache;
- streamed loader: the same with `data.streaming=true`, one stream against a `MixedStream` of
  three.
"""

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import machine_line, markdown, publish

from src.data.sampler import ResumableDistributedSampler
from src.data.text.pretraining import TextDataModule
from src.data.text.sources.mixture import MixtureSampler
from src.utils.error_boundary import exit_in_one_line

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT / "src" / "data" / "assets" / "tinyshakespeare.txt"
WEIGHTS = (0.5, 0.3, 0.2)
DRAW_COLUMNS = ("rows", "one source", "mixture of 3", "ratio")
LOADER_COLUMNS = ("corpus", "source", "setup (cold)", "rows/s", "ratio")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round: seconds")
    parser.add_argument("--rows", default="100000,1000000,10000000", help="comma-separated")
    parser.add_argument("--sizes", default="1,10", help="corpus sizes in MB, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=200, help="batches per loader round")
    parser.add_argument("--output", type=Path, help="write the Markdown section there too")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.sizes, args.repeats, args.batches = "10000", "0.2", 1, 20
    return args


def draw_seconds(sampler: ResumableDistributedSampler, repeats: int) -> float:
    times = []
    for epoch in range(repeats):
        sampler.set_epoch(epoch)
        started = time.perf_counter()
        sampler.rank_indices()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def epoch_draws(args: argparse.Namespace) -> list[dict[str, str]]:
    rows = []
    for count in (int(n) for n in args.rows.split(",")):
        sizes = [round(count * w) for w in WEIGHTS]
        sizes[0] += count - sum(sizes)
        options = dict(num_replicas=1, rank=0, shuffle=True, seed=0)
        one = draw_seconds(ResumableDistributedSampler(range(count), **options), args.repeats)
        mixed = MixtureSampler(range(count), sizes, WEIGHTS, **options)
        three = draw_seconds(mixed, args.repeats)
        rows.append(
            {
                "rows": f"{count:,}",
                "one source": f"{one * 1e3:,.1f} ms",
                "mixture of 3": f"{three * 1e3:,.1f} ms",
                "ratio": f"{three / one:.2f}x",
            }
        )
    return rows


def write_corpus(folder: Path, megabytes: float) -> list[Path]:
    """Three files of Shakespeare's speeches, `megabytes` in all, in WEIGHTS' proportions."""
    speeches = SHAKESPEARE.read_text().split("\n\n")
    rng = random.Random(0)
    files = []
    for index, weight in enumerate(WEIGHTS):
        size, texts = megabytes * weight * 1e6, []
        while size > 0:
            texts.append(" ".join(rng.choices(speeches, k=rng.randint(1, 4))))
            size -= len(texts[-1]) + 2
        files.append(folder / f"part-{index}.txt")
        files[-1].write_text("\n\n".join(texts))
    return files


def loader_module(files: list[Path], mixed: bool, streaming: bool, cache: Path) -> TextDataModule:
    """The training data of `files`: one source, or each file a source weighted by WEIGHTS.

    Streamed, every source validates on its own file (held-out files are not what is timed).
    """
    options: dict = dict(max_seq_len=256, batch_size=16, shuffle_seed=0, cache_dir=str(cache))
    if streaming:
        options |= {"streaming": True, "packing_buffer": 1000}
    if not mixed:
        held_out = {"val_paths": [str(files[0])]} if streaming else {}
        return TextDataModule(paths=[str(f) for f in files], **held_out, **options)
    mixture = [
        {"paths": [str(f)], "weight": w, **({"val_paths": [str(f)]} if streaming else {})}
        for f, w in zip(files, WEIGHTS, strict=True)
    ]
    return TextDataModule(paths=[], mixture=mixture, **options)


def rows_per_second(loader, batches: int) -> float:
    """Training rows/s of the next `batches` batches of `loader` (a started iterator)."""
    rows, started = 0, time.perf_counter()
    for _ in range(batches):
        rows += len(next(loader)["input_ids"])
    return rows / (time.perf_counter() - started)


def loaders(args: argparse.Namespace, work: Path) -> list[dict[str, str]]:
    results = []
    for megabytes in (float(n) for n in args.sizes.split(",")):
        folder = work / f"{megabytes:g}MB"
        folder.mkdir()
        files = write_corpus(folder, megabytes)
        for streaming in (False, True):
            iterators, setups = {}, {}
            for mixed in (False, True):
                module = loader_module(
                    files, mixed, streaming, folder / f"cache-{streaming}-{mixed}"
                )
                started = time.perf_counter()
                module.setup()
                setups[mixed] = time.perf_counter() - started
                iterators[mixed] = iter(endless(module))
                next(iterators[mixed])  # the first batch (a stream's first buffer) is cold start
            rates: dict[bool, list[float]] = {False: [], True: []}
            for round_number in range(args.repeats):
                order = (False, True) if round_number % 2 == 0 else (True, False)
                for mixed in order:
                    rates[mixed].append(rows_per_second(iterators[mixed], args.batches))
            reference = statistics.median(rates[False])
            for mixed in (False, True):
                rate = statistics.median(rates[mixed])
                results.append(
                    {
                        "corpus": f"{megabytes:g} MB" + (", streamed" if streaming else ""),
                        "source": "mixture of 3" if mixed else "one",
                        "setup (cold)": f"{setups[mixed]:.2f} s",
                        "rows/s": f"{rate:,.0f}",
                        "ratio": f"{rate / reference:.2f}x",
                    }
                )
    return results


def endless(module: TextDataModule):
    """The module's training batches, epoch after epoch."""
    while True:
        yield from module.train_dataloader()


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, str]]]:
    args = parse_args(argv)
    draws = epoch_draws(args)
    with tempfile.TemporaryDirectory(prefix="bench-mixture-") as work:
        loading = loaders(args, Path(work))
    report = "\n\n".join(
        [
            "## Data mixtures (`scripts/bench_mixture.py`)",
            machine_line(),
            "An epoch's draw of the training rows (at the start of each epoch):",
            markdown(draws, DRAW_COLUMNS),
            "Training loader, 16 rows of 256 bytes a batch:",
            markdown(loading, LOADER_COLUMNS),
        ]
    )
    publish(report, args.output)
    return {"draws": draws, "loaders": loading}


if __name__ == "__main__":
    exit_in_one_line(main)()
