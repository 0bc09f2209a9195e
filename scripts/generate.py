"""Continue a prompt with a trained QwenLM.

    python scripts/generate.py --ckpt logs/train/runs/<run>/checkpoints/last.ckpt --prompt "ROMEO:"
    python scripts/generate.py --hf <folder with config.json + model.safetensors> \
        --tokenizer <same folder> --prompt "The capital of France is" --temperature 0

--ckpt reads a Lightning checkpoint written by src.models.language_model.LanguageModel (loaded
with weights_only=True); --hf a transformers-format folder, e.g. a released Qwen3 checkpoint.
Text is byte-level unless the checkpoint's run directory holds the run's tokenizer (runs with a
BPE or pretrained tokenizer save it in <run dir>/tokenizer/); --tokenizer <folder> uses the
tokenizer.json of that folder (a transformers model folder, for instance).
"""

import argparse
from pathlib import Path

import torch

from src.data.tokenizers import ByteTokenizer, load_pretrained
from src.models.language_model import LanguageModel
from src.models.qwen import QwenLM
from src.utils.errors import MissingFileError, exit_on_user_error


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
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args(argv)


def load_model(args: argparse.Namespace) -> QwenLM:
    if args.hf is not None:
        return QwenLM.from_pretrained(args.hf)
    if not args.ckpt.is_file():
        raise MissingFileError(f"--ckpt {args.ckpt} is not a file")
    module = LanguageModel.load_from_checkpoint(args.ckpt, map_location="cpu", weights_only=True)
    return module.net


def load_tokenizer(folder: Path | None, ckpt: Path | None):
    """The tokenizer in `folder`, else the one saved in the checkpoint's run directory (BPE or
    pretrained runs save it there), else bytes."""
    if folder is None and ckpt is not None:
        saved = ckpt.resolve().parent.parent / "tokenizer"
        folder = saved if (saved / "tokenizer.json").is_file() else None
    return ByteTokenizer() if folder is None else load_pretrained(folder)


@exit_on_user_error
def main(argv: list[str] | None = None) -> list[str]:
    args = parse_args(argv)
    model = load_model(args).to(args.device).eval()
    tokenizer = load_tokenizer(args.tokenizer, args.ckpt)
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise SystemExit("--prompt encodes to no tokens; give at least one character")
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
