#!/usr/bin/env bash
# The checks only a GPU can run, in one go: sized for 10 minutes on one H200 (not yet timed).
#
#   pip install -e ".[dev,gpu]"          # once: flash-linear-attention and causal-conv1d
#   bash scripts/gpu_check.sh            # writes logs/gpu_check/<time>/summary.md
#   DEV=cpu bash scripts/gpu_check.sh    # dry run on a CPU: every step but the CUDA-only ones
#
# Steps: the torch / CUDA / device facts; the fused kernels against the PyTorch path, the
# model against transformers, packed against padded rows and bf16 against fp32 on the device
# (scripts/gpu_parity.py, which logs the path each layer took); `experiment=lm_text` for
# STEPS steps under trainer=fsdp and trainer=model_parallel; a bf16 supervised fine-tuning run
# of the Qwen3.5-0.8B shape at its vocabulary of 248,320 (MFU) and a bf16 mixture-of-experts
# run (32 experts, 4 per token, grouped_mm on the device); scripts/bench_lm.py on the 0.6B
# config, at Qwen3's vocabulary (peak memory) and fine-tuning the 0.6B in full or with LoRA,
# activation checkpointing off and on. Each step's output goes to its own log; summary.md is
# one Markdown table ready for docs/BENCHMARKS.md. A failing step is recorded and the others
# still run; the exit status is 1 when any failed.
set -uo pipefail
cd "$(dirname "$0")/.."

DEV=${DEV:-cuda}
STEPS=${STEPS:-40}
PY=${PY:-python}
OUT_DIR=${OUT_DIR:-logs/gpu_check/$(date +%Y-%m-%d_%H-%M-%S)}
mkdir -p "$OUT_DIR"
RESULTS="$OUT_DIR/steps.tsv"
: >"$RESULTS"

if [[ $DEV != cuda && $DEV != cpu ]]; then
    echo "DEV must be cuda or cpu, not '$DEV'" >&2
    exit 2
fi
if [[ $DEV == cuda ]] && ! $PY -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "No CUDA device here: run DEV=cpu bash scripts/gpu_check.sh for the dry run" >&2
    exit 2
fi

# step NAME COMMAND...: run it, keep its output in NAME.log, record status and seconds.
step() {
    local name=$1
    shift
    echo "== $name: $*"
    local start=$SECONDS
    if "$@" >"$OUT_DIR/$name.log" 2>&1; then
        printf '%s\tok\t%s\n' "$name" "$((SECONDS - start))" >>"$RESULTS"
    else
        printf '%s\tFAILED\t%s\n' "$name" "$((SECONDS - start))" >>"$RESULTS"
        tail -n 20 "$OUT_DIR/$name.log"
    fi
}
skip() {
    printf '%s\tskipped (%s)\t0\n' "$1" "$2" >>"$RESULTS"
}

# train NAME EXPERIMENT OVERRIDES...: a short run of conf/experiment/EXPERIMENT.yaml in its own
# run directory.
train() {
    local name=$1 experiment=$2
    shift 2
    step "$name" $PY train.py experiment="$experiment" trainer.max_steps="$STEPS" \
        trainer.val_check_interval="$STEPS" trainer.limit_val_batches=4 test=false \
        callbacks.rich_progress_bar=null logger=csv hydra.run.dir="$OUT_DIR/$name" "$@"
}
# The mixture of experts of bench_moe's comparison: 32 experts, 4 per token, every layer sparse.
MOE=(model=qwen3_moe_tiny model.config.num_experts=32 model.config.num_experts_per_tok=4)
# SFT on the synthetic conversations, exact match on a few validation prompts.
SFT=(data.exact_match_samples=4)

step facts $PY scripts/check_env.py
if command -v nvidia-smi >/dev/null; then
    nvidia-smi >>"$OUT_DIR/facts.log" 2>&1
fi

step parity $PY scripts/gpu_parity.py --device "$DEV" --output "$OUT_DIR/parity.md"

if [[ $DEV == cuda ]]; then
    train fsdp lm_text trainer=fsdp trainer.devices=1
    train model_parallel lm_text trainer=model_parallel trainer.devices=1 \
        trainer.strategy.data_parallel_size=1
    train sft_qwen3_5 lm_sft model=qwen3_5_0_8b trainer.precision=bf16-mixed \
        data.max_seq_len=2048 data.batch_size=8 "${SFT[@]}"
    train moe lm_text "${MOE[@]}" model.config.hidden_size=1024 \
        model.config.moe_intermediate_size=512 model.config.num_hidden_layers=8 \
        trainer.precision=bf16-mixed data.max_seq_len=2048 data.batch_size=8
    step bench_lm $PY scripts/bench_lm.py --device cuda --models qwen3_0_6b hybrid \
        --repeats 3 --output "$OUT_DIR/bench_lm.md"
    step bench_vocab $PY scripts/bench_lm.py --device cuda --models dense --vocab-size 151936 \
        --hidden-size 256 --layers 2 --batch-size 2 --seq-len 2048 --memory --repeats 3 \
        --output "$OUT_DIR/bench_vocab.md"
    step bench_finetune $PY scripts/bench_lm.py --device cuda --finetune --models qwen3_0_6b \
        --batch-size 8 --seq-len 2048 --precisions bf16-mixed --repeats 3 \
        --output "$OUT_DIR/bench_finetune.md"
else
    skip fsdp "Lightning runs FSDP on CUDA only"
    train model_parallel lm_text trainer=model_parallel trainer.devices=1 \
        trainer.strategy.data_parallel_size=1 trainer.accelerator=cpu trainer.precision=32-true \
        model=qwen3_tiny data.max_seq_len=64 data.batch_size=4
    train sft_qwen3_5 lm_sft model=qwen3_5_tiny trainer.accelerator=cpu \
        trainer.precision=32-true data.max_seq_len=128 data.batch_size=4 "${SFT[@]}"
    train moe lm_text "${MOE[@]}" trainer.accelerator=cpu trainer.precision=32-true \
        trainer.log_every_n_steps=2 data.max_seq_len=64 data.batch_size=4
    # One model and precision: every --quick row is tests/scripts/test_qwen_bench.py's.
    step bench_lm $PY scripts/bench_lm.py --device cpu --quick --models dense --precisions fp32 \
        --output "$OUT_DIR/bench_lm.md"
    step bench_vocab $PY scripts/bench_lm.py --device cpu --quick --models dense --precisions fp32 \
        --vocab-size 4096 --layers 1 --memory --output "$OUT_DIR/bench_vocab.md"
    # QLoRA: full fine-tuning's and LoRA's rows are tests/scripts/test_qwen_bench.py's.
    step bench_finetune $PY scripts/bench_lm.py --device cpu --quick --finetune --models dense \
        --precisions fp32 --variants qlora --output "$OUT_DIR/bench_finetune.md"
fi

$PY - "$OUT_DIR" <<'EOF'
"""summary.md: one row per step, with the figures its run directory or report holds."""
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
rows = ["| step | status | seconds | result |", "|---|---|---|---|"]
for line in (out / "steps.tsv").read_text().splitlines():
    name, status, seconds = line.split("\t")
    result = ""
    metrics = out / name / "metrics.json"
    if metrics.is_file():
        values = json.loads(metrics.read_text()).get("metrics", {})
        shown = ("train/loss", "perf/tokens_per_s", "perf/mfu", "perf/peak_memory_gib")
        result = ", ".join(f"{k} {values[k]:.4g}" for k in shown if k in values)
    rows.append(f"| {name} | {status} | {seconds} | {result} |")
facts = (out / "facts.log").read_text().splitlines()[:12] if (out / "facts.log").is_file() else []
names = ("parity.md", "bench_lm.md", "bench_vocab.md", "bench_finetune.md")
reports = [(out / name).read_text() for name in names if (out / name).is_file()]
summary = "\n".join(["```", *facts, "```", "", *rows, "", *reports])
(out / "summary.md").write_text(summary + "\n")
print(summary)
EOF

if grep -q $'\tFAILED\t' "$RESULTS"; then
    echo "Some steps failed: see $OUT_DIR/<step>.log"
    exit 1
fi
echo "All steps passed: $OUT_DIR/summary.md"
