"""Rollout throughput: GRPO's sampling against transformers' `generate` on the same weights.

    python scripts/bench_lm.py --rollouts                 # the same as the line below
    python scripts/bench_rollouts.py                      # tiny Qwen3 and Qwen3.5: 16 prompts x 8
    python scripts/bench_rollouts.py --quick              # a few seconds
    python scripts/bench_rollouts.py --models qwen3_tiny qwen3_5_tiny --hidden-size 512 --layers 8

For each model a randomly initialised QwenLM is saved with save_pretrained and loaded by
transformers, so both decode with the same weights. Ours samples as a GRPO step does
(src/models/language/grpo/rollouts.py: QwenLM's KV-cache `generate`, every group's copies of a
prompt in one batch); transformers' `generate` gets the same rows, `do_sample=True` at
temperature 1 with its KV cache. Both decode exactly `--new-tokens` tokens per row (no
end-of-turn token can be drawn), so the rate is rows x new tokens over the time. Greedy
decodings are compared first (the share of equal tokens). The first call of each is reported
apart (cold start), then the two alternate `--repeats` times, their order swapped every repeat;
the table shows medians.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from benchmarks import machine_line, markdown, model_config, publish

from src.callbacks.measurement.peak_flops import synchronize
from src.models.language.grpo.rollouts import sample
from src.models.language.qwen import QwenConfig, QwenLM
from src.utils.error_boundary import exit_in_one_line
from src.utils.transformers_fallback import use_pytorch_kernels_in_transformers

COLUMNS = ("model", "params", "rows x new tokens", "ours tok/s", "transformers tok/s",
           "speedup", "cold start ours / transformers", "greedy tokens equal")  # fmt: skip
PAD = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: seconds")
    parser.add_argument("--models", nargs="+", default=["qwen3_tiny", "qwen3_5_tiny"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden-size", type=int, help="resize every model's hidden size")
    parser.add_argument("--layers", type=int, help="resize every model's decoder layers")
    parser.add_argument("--device", type=torch.device, default=torch.device("cpu"))
    parser.add_argument("--output", type=Path, help="write the Markdown table there too")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.generations, args.new_tokens, args.repeats = 2, 4, 8, 1
    return args


def resized(config: QwenConfig, args) -> QwenConfig:
    changes = {}
    if args.hidden_size:
        changes["hidden_size"] = args.hidden_size
        changes["intermediate_size"] = 3 * args.hidden_size
    if args.layers:
        changes.update(num_hidden_layers=args.layers, layer_types=None)
    return QwenConfig.from_dict({**config.to_dict(), **changes})


def decoders(config: QwenConfig, folder: str, device: torch.device):
    """(ours, transformers'): the same random weights, in eval mode on `device`."""
    import transformers

    torch.manual_seed(0)
    QwenLM(config).save_pretrained(folder)
    ours = QwenLM.from_pretrained(folder).to(device).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).to(device).eval()
    return ours, theirs


def ours_rollout(model: QwenLM, prompts: torch.Tensor, args, greedy: bool = False):
    """As a GRPO step samples: `generations` copies of each prompt, decoded in one batch."""
    batch = {"input_ids": prompts, "prompt_lengths": torch.full((len(prompts),), prompts.shape[1])}
    never = model.config.vocab_size  # no token id ends a completion early
    sampling = {"temperature": 0.0} if greedy else {"temperature": 1.0}
    copies = 1 if greedy else args.generations
    return sample(model, batch, copies, args.new_tokens, never, PAD, **sampling).input_ids


@torch.no_grad()
def transformers_rollout(model, prompts: torch.Tensor, args, greedy: bool = False):
    rows = prompts if greedy else prompts.repeat_interleave(args.generations, 0)
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0,
                                                    "top_p": 1.0, "top_k": 0}  # fmt: skip
    return model.generate(
        rows,
        attention_mask=torch.ones_like(rows),
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        eos_token_id=None,
        pad_token_id=PAD,
        **sampling,
    )


def timed(run, device: torch.device) -> float:
    start = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - start


def compare(name: str, args) -> dict[str, str]:
    config = resized(model_config(name, args.quick), args)
    with tempfile.TemporaryDirectory() as folder:
        ours, theirs = decoders(config, folder, args.device)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(
        1, config.vocab_size, (args.prompts, args.prompt_len), generator=generator
    )
    prompts = prompts.to(args.device)
    greedy = [run(model, prompts, args, greedy=True)[:, args.prompt_len :]
              for run, model in ((ours_rollout, ours), (transformers_rollout, theirs))]  # fmt: skip
    equal = (greedy[0] == greedy[1]).float().mean().item()
    runs = {
        "ours": lambda: ours_rollout(ours, prompts, args),
        "transformers": lambda: transformers_rollout(theirs, prompts, args),
    }
    cold = {key: timed(run, args.device) for key, run in runs.items()}
    times: dict[str, list[float]] = {key: [] for key in runs}
    for repeat in range(args.repeats):
        for key in list(runs)[:: 1 if repeat % 2 == 0 else -1]:
            times[key].append(timed(runs[key], args.device))
    tokens = args.prompts * args.generations * args.new_tokens
    rate = {key: tokens / statistics.median(values) for key, values in times.items()}
    return {
        "model": name,
        "params": f"{sum(p.numel() for p in ours.parameters()) / 1e6:.1f}M",
        "rows x new tokens": f"{args.prompts * args.generations} x {args.new_tokens}",
        "ours tok/s": f"{rate['ours']:,.0f}",
        "transformers tok/s": f"{rate['transformers']:,.0f}",
        "speedup": f"{rate['ours'] / rate['transformers']:.2f}x",
        "cold start ours / transformers": f"{cold['ours']:.2f} s / {cold['transformers']:.2f} s",
        "greedy tokens equal": f"{equal:.1%}",
    }


def main(argv: list[str] | None = None) -> list[dict[str, str]]:
    import transformers

    use_pytorch_kernels_in_transformers()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    args = parse_args(argv)
    rows = [compare(name, args) for name in args.models]
    command = "python scripts/bench_rollouts.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    report = "\n".join([
        machine_line(transformers=transformers.__version__),
        f"Device: {args.device}; {args.prompts} prompts of {args.prompt_len} tokens x "
        f"{args.generations} completions of {args.new_tokens} tokens, sampled at temperature 1; "
        f"median of {args.repeats} rounds; command: `{command.strip()}`",
        "",
        markdown(rows, COLUMNS),
    ])  # fmt: skip
    publish(report, args.output)
    return rows


if __name__ == "__main__":
    exit_in_one_line(main)()
