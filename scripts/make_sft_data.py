"""Write the synthetic instruction set (arithmetic and string tasks, exactly checkable) as JSONL.

    python scripts/make_sft_data.py --out data/sft.jsonl --count 5000 --seed 0
    python train.py experiment=lm_sft data.path=data/sft.jsonl

Three lines in four are {"prompt": ..., "response": ...}, one in four the chat form
{"messages": [...]}; the same seed writes the same file (see src/data/text/synthetic_sft.py).
"""

import argparse
from pathlib import Path

from src.data.text.synthetic_sft import TASKS, make_examples, write_jsonl
from src.utils.error_boundary import exit_in_one_line


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    parser.add_argument("--count", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_jsonl(make_examples(args.count, args.seed), args.out)
    print(f"Wrote {args.count} examples of {len(TASKS)} tasks ({', '.join(TASKS)}) to {args.out}")
    return args.out


if __name__ == "__main__":
    exit_in_one_line(main)()
