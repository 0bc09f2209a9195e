"""Check that packing leaves a language model's results unchanged, before trusting it.

    python scripts/check_packing.py                                   # model=qwen3_next_tiny
    python scripts/check_packing.py model=qwen3_tiny
    python scripts/check_packing.py model=qwen3_0_6b --row-length 256 --lengths 1,100,37,118

Builds the model of the given config overrides (as `train.py` would, in fp32, with freshly
initialised weights unless the config loads pretrained ones), feeds the same random documents
packed and padded, and prints the largest difference per check (see
`src/data/packing/checks.py`). Exits with status 1 when a check fails its tolerance.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import hydra
import torch

from src.data.packing.checks import DEFAULT_LENGTHS, TOLERANCES, random_documents, run_checks
from src.models.language.language_model import LanguageModel
from src.run.config.compose import compose_run_config
from src.utils.error_boundary import exit_in_one_line
from src.utils.errors import ConfigError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. model=qwen3_tiny")
    parser.add_argument(
        "--lengths",
        default=",".join(map(str, DEFAULT_LENGTHS)),
        help="document lengths, comma-separated (include 1 and lengths off the chunk size)",
    )
    parser.add_argument("--row-length", type=int, default=64, help="packed row length")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def build_network(overrides: list[str]) -> torch.nn.Module:
    """The `net` of the LanguageModel that `train.py <overrides>` would train."""
    overrides = overrides or ["model=qwen3_next_tiny"]
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = compose_run_config(Path(run_dir), overrides)
        module = hydra.utils.instantiate(cfg.model)
    if not isinstance(module, LanguageModel):
        raise ConfigError(
            f"{type(module).__name__} is not a language model; choose one, e.g. model=qwen3_tiny"
        )
    return module.net.float()


@exit_in_one_line
def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    if max(lengths) > args.row_length or min(lengths) < 1:
        raise ConfigError(f"--lengths must lie in [1, --row-length={args.row_length}]")
    torch.manual_seed(args.seed)
    network = build_network(args.overrides)
    documents = random_documents(network.config.vocab_size, lengths, args.seed)
    results = run_checks(network, documents, args.row_length)
    print(f"{'check':<24} {'max difference':>15} {'tolerance':>10}  verdict")
    for name, value in results.items():
        verdict = "ok" if value <= TOLERANCES[name] else "FAILED"
        print(f"{name:<24} {value:>15.3e} {TOLERANCES[name]:>10.0e}  {verdict}")
    failed = [name for name, value in results.items() if value > TOLERANCES[name]]
    if failed:
        print(f"Packing changes this model's results ({', '.join(failed)}): do not pack.")
        sys.exit(1)
    print("Packed and padded batches agree: packing is safe for this model.")
    return results


if __name__ == "__main__":
    main()
