"""Continue a prompt with a trained QwenLM.

    python scripts/generate.py --ckpt logs/train/runs/<run>/checkpoints/last.ckpt --prompt "ROMEO:"
    python scripts/generate.py --hf <folder with config.json + model.safetensors> \
        --tokenizer <same folder> --prompt "The capital of France is" --temperature 0

--ckpt restores a checkpoint of a LanguageModel written by train.py (weights-only, see
src/checkpoints/restore.py) with the run's own tokenizer, which the checkpoint carries; --hf
reads a transformers-format folder, e.g. a released Qwen3 checkpoint, with byte-level text.
--tokenizer <folder> uses the tokenizer.json of that folder instead (a transformers model
folder, or the <run dir>/tokenizer/ of a checkpoint older than tokenizers in checkpoints).
"""

import argparse
from pathlib import Path

import torch

from src.checkpoints.restore import restore
from src.data.corpus.tokenizers import ByteTokenizer, load_pretrained
from src.models.language.language_model import LanguageModel
from src.models.language.qwen import QwenLM
from src.utils.contracts import Tokenizer
from src.utils.error_boundary import exit_in_one_line
from src.utils.errors import CheckpointError, ConfigError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt", type=Path, help="Lightning checkpoint of a LanguageModel")
    source.add_argument("--hf", type=Path, help="transformers-format model folder")
    parser.add_argument("--prompt", default="\n", help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=300)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest")
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", type=Path, default=None, help="folder with a tokenizer.json")
    parser.add_argument(
        "--base", type=Path, default=None, help="a LoRA run's base folder, where it moved to"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    check_counts(args)
    return args


def check_counts(args: argparse.Namespace) -> None:
    """Refuse counts that would generate nothing or fail inside the sampler."""
    for name, value, least in (
        ("--max-new-tokens", args.max_new_tokens, 1),
        ("--num-samples", args.num_samples, 1),
        ("--top-k", args.top_k, 1),
    ):
        if value is not None and value < least:
            raise ConfigError(f"{name} {value}: give a whole number of at least {least}.")
    if args.temperature < 0:
        raise ConfigError(
            f"--temperature {args.temperature}: give 0 for greedy decoding or a positive value."
        )


def load_model(args: argparse.Namespace) -> tuple[QwenLM, Tokenizer]:
    """The network and the tokenizer its text is written and read with: --tokenizer's, else
    the checkpoint's (bytes for --hf)."""
    folder = args.tokenizer
    given = load_pretrained(folder) if folder else None
    if args.hf is not None:
        return QwenLM.from_pretrained(args.hf), given or ByteTokenizer()
    moved_base = [f"model.pretrained='{args.base}'"] if args.base else []
    try:
        restored = restore(args.ckpt, moved_base)
    except CheckpointError:
        if folder is None:
            raise
        # A checkpoint without its tokenizer (older than tokenizers in checkpoints) whose BPE
        # was trained in the run: the folder given is that tokenizer.
        pretrained = ["data.tokenizer.kind=pretrained", f"data.tokenizer.path='{folder}'"]
        restored = restore(args.ckpt, [*pretrained, *moved_base])
    if not isinstance(restored.model, LanguageModel):
        raise CheckpointError(
            f"{args.ckpt} is a checkpoint of {restored.config.model._target_}, not of a language "
            f"model: generate.py continues text with a checkpoint of a model=qwen3_tiny (or "
            f"another language model) run. For an image classifier use predict.py "
            f"ckpt_path={args.ckpt} input=<image or folder>."
        )
    return restored.model.net, given or restored.tokenizer


@exit_in_one_line
def main(argv: list[str] | None = None) -> list[str]:
    args = parse_args(argv)
    model, tokenizer = load_model(args)
    model = model.to(args.device).eval()
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise ConfigError("--prompt encodes to no tokens; give at least one character.")
    input_ids = torch.tensor([prompt] * args.num_samples, device=args.device)
    generator = torch.Generator(args.device).manual_seed(args.seed)
    output = model.generate(
        input_ids,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        eos_token_id=tokenizer.eos_token_id,
        generator=generator,
    )
    texts = [tokenizer.decode(row.tolist()) for row in output]
    for i, text in enumerate(texts):
        print(f"--- sample {i + 1} ---\n{text}" if len(texts) > 1 else text)
    return texts


if __name__ == "__main__":
    main()
