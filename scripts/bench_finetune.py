"""Fine-tuning variants side by side: full, LoRA and QLoRA, activation checkpointing off and on.

    python scripts/bench_lm.py --finetune --models qwen3_0_6b --batch-size 1 --seq-len 512
    python scripts/bench_lm.py --finetune --models qwen3_5_0_8b --batch-size 1 --seq-len 512 \
        --variants full lora --implementations ours transformers  # and Qwen3_5ForCausalLM

`scripts/bench_lm.py --finetune` runs it, with that script's options. Each variant trains in a
process of its own (peak memory is per process): every weight (full fine-tuning), LoRA r=16
adapters on the frozen base, or QLoRA (the same adapters on the base's linear weights stored as
NF4, the rest of the base in bf16, `adapter=qlora`), each with activation checkpointing off and
on (`--variants` picks some), for QwenLM and for transformers' model of the same weights
(`--implementations`, default ours; transformers' LoRA is peft's on the same projections, its
checkpointing `gradient_checkpointing_enable`; it has no QLoRA here, whose transformers path is
bitsandbytes' on CUDA). Rows: trainable parameters, the model's bytes as stored (metrics.json's
`model/parameter_bytes`), peak memory over the training steps (the peak is reset once the model
is built, so that loading a base in fp32 before quantising it is not counted), the median step
and MFU (counting full training's FLOPs for every variant: LoRA skips the base's weight
gradients).
"""

import json
import statistics
import tempfile
from pathlib import Path

import torch
from bench_lm import (
    MODELS,
    Runner,
    batch_of,
    child_args,
    child_options,
    peak_bytes,
    reset_peak,
    resized,
)
from benchmarks import in_fresh_process, model_config

from src.models.language.adapters import build_adapter
from src.models.language.lora.quantization import Quantization
from src.models.language.lora.spec import DEFAULT_TARGETS
from src.models.language.qwen import QwenLM
from src.utils.tensor_bytes import module_bytes

# The adapter's values (none: full fine-tuning) per adapter, and its name in the table.
LORA = {"r": 16, "alpha": 32, "dropout": 0.0}
QLORA = {**LORA, "quantization": Quantization().to_dict()}  # NF4, bf16: conf/adapter/qlora.yaml
ADAPTERS = {
    "full": ("full", None),
    "lora": ("LoRA r=16", LORA),
    "qlora": ("QLoRA r=16 (NF4, bf16)", QLORA),
}
VARIANTS = {
    f"{label}{', activation checkpointing' if checkpointed else ''}": (name, values, checkpointed)
    for name, (label, values) in ADAPTERS.items()
    for checkpointed in (False, True)
}
FINETUNE_COLUMNS = ("model", "precision", "implementation", "variant", "trainable params",
                    "parameter bytes", "peak memory", "step", "tok/s", "MFU",
                    "cold start")  # fmt: skip


def ours(folder: str, adapter: dict | None, checkpointed: bool) -> torch.nn.Module:
    net = QwenLM.from_pretrained(folder)
    for layer in net.model.layers:
        layer.checkpointed = checkpointed
    build_adapter(net, adapter, folder)
    return net


def transformers_model(folder: str, adapter: dict | None, checkpointed: bool) -> torch.nn.Module:
    """transformers' model of `folder`, with peft's LoRA on the projections ours adapts."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    if checkpointed:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    if adapter is None:
        return model
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    config = peft.LoraConfig(
        r=adapter["r"],
        lora_alpha=adapter["alpha"],
        lora_dropout=adapter["dropout"],
        target_modules=[target for target in DEFAULT_TARGETS if target in names],
    )
    return peft.get_peft_model(model, config)


def finetune_here(
    folder: str, implementation: str, variant: str, precision: str, options: str
) -> None:
    """`finetune`'s child: one variant of one implementation from `folder`, trained on one
    batch: the first step (cold), one warm-up, then `repeats` rounds of `steps` steps."""
    args = child_args(options)
    _, adapter, checkpointed = VARIANTS[variant]
    build = ours if implementation == "ours" else transformers_model
    model = build(folder, adapter, checkpointed).to(args.device)
    vocab_size = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    runner = Runner(model, batch_of(vocab_size, args), precision == "bf16-mixed",
                    calls_transformers=implementation == "transformers")  # fmt: skip
    reset_peak(args.device)
    cold = runner.timed(1)
    runner.timed(1)
    rounds = [runner.timed(args.steps) / args.steps for _ in range(args.repeats)]
    parameters = list(model.parameters())
    trainable = sum(p.numel() for p in parameters if p.requires_grad)
    result = {"cold_s": cold, "step_s": statistics.median(rounds), "trainable": trainable}
    stored = {
        "parameter_bytes": module_bytes(model),
        "parameters": sum(map(torch.numel, parameters)),
    }
    print(json.dumps({**result, **stored, "peak_bytes": peak_bytes(args.device)}))


def finetune(kind: str, precision: str, args, peaks) -> list[dict[str, str]]:
    """The chosen variants of each chosen implementation, each in its own process."""
    config = resized(model_config(MODELS.get(kind, kind), args.quick), args)
    torch.manual_seed(0)
    rows = []
    peak = peaks["bf16" if precision == "bf16-mixed" else "fp32"][0]
    with tempfile.TemporaryDirectory() as folder:
        net = QwenLM(config)
        flops = net.flops_per_token(args.seq_len)  # full training's, whatever trains
        net.save_pretrained(folder)
        del net
        for implementation in args.implementations:
            for variant, (name, *_) in VARIANTS.items():
                if name not in args.variants or (implementation, name) == ("transformers", "qlora"):
                    continue
                options = (folder, implementation, variant, precision, child_options(args))
                result = in_fresh_process("bench_finetune", f"finetune_here{options!r}")
                tokens = args.batch_size * args.seq_len
                rows.append({
                    "model": kind, "precision": precision, "implementation": implementation,
                    "variant": variant,
                    "trainable params": f"{result['trainable'] / 1e6:,.2f}M",
                    "parameter bytes": f"{result['parameter_bytes'] / 2**20:,.0f} MiB "
                    f"({result['parameter_bytes'] / result['parameters']:.2f} B/param)",
                    "peak memory": f"{result['peak_bytes'] / 2**30:.2f} GiB",
                    "step": f"{result['step_s']:.2f} s",
                    "tok/s": f"{tokens / result['step_s']:,.0f}",
                    "MFU": f"{tokens / result['step_s'] * flops / peak:.1%}",
                    "cold start": f"{result['cold_s']:.2f} s",
                })  # fmt: skip
    return rows
