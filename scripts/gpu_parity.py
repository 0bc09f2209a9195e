"""Numerical checks of the LM on one device: the GPU half of what the CPU test suite proves.

    python scripts/gpu_parity.py --device cuda --output parity.md
    python scripts/gpu_parity.py --device cpu     # what runs without CUDA (the dry run)

On the device, with the tiny dense and hybrid configs of conf/model:
- `vs transformers`: fp32 logits of this model and transformers' on the same weights;
- `fused vs PyTorch, fp32`: flash-linear-attention and causal-conv1d (which take fp32) against
  the PyTorch recurrence and convolution, packed and unpacked, logits and every gradient;
- `fused vs PyTorch, bf16`: every kernel (FlashAttention varlen too) under bf16 autocast, loss;
- `packed vs padded`: src/data/packing/checks.py's checks (logits, loss, gradients, leaks);
- `bf16 vs fp32`: the hybrid's loss and gradient direction under bf16 autocast.
The fused checks need CUDA and the `gpu` extra; without them they are reported as skipped.
Each layer logs the path it took (INFO lines on stderr). Exits with status 1 when a check
exceeds its tolerance.
"""

import argparse
import dataclasses
import logging
import sys
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from benchmarks import machine_line, markdown, model_config, publish

from src.data.packing.checks import DEFAULT_LENGTHS, TOLERANCES, random_documents, run_checks
from src.models.language.qwen import QwenLM
from src.models.language.qwen.kernels import PYTORCH, Kernels, installed_kernels
from src.utils.error_boundary import exit_in_one_line
from src.utils.transformers_fallback import use_pytorch_kernels_in_transformers

MODELS = {"dense": "qwen3_tiny", "hybrid": "qwen3_next_tiny"}
ROW_LENGTH = 64
COLUMNS = ("check", "model", "value", "tolerance", "verdict")
# bf16 keeps 8 bits of mantissa: relative differences of a few 1e-3 per op add up over layers.
BF16_TOLERANCE = 5e-2
BF16_MISALIGNMENT = 1e-2  # 1 - cosine of all gradients, bf16 autocast against fp32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", type=torch.device, default="cuda")
    parser.add_argument("--output", type=Path, help="write the Markdown report there too")
    return parser.parse_args(argv)


def build(
    kind: str, device: torch.device, kernels: Kernels | None = None, perturb: bool = True
) -> QwenLM:
    """The tiny config of `kind` with weights from seed 0 (the same for every call). `perturb`
    moves its norms, gates and decay rates away from their initial values, so that a mix-up
    between two parameters cannot hide."""
    torch.manual_seed(0)
    model = QwenLM(model_config(MODELS[kind]), kernels)
    if perturb:
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.ndim == 1:
                    parameter.add_(0.3 * torch.randn_like(parameter))
    return model.to(device)


def token_batch(model: QwenLM, device: torch.device, packed: bool) -> dict:
    """Two rows of 64 tokens; packed: each row holds documents of 40 and 24 tokens."""
    ids = torch.randint(0, model.config.vocab_size, (2, ROW_LENGTH), device=device)
    if not packed:
        return {"input_ids": ids}
    starts = [0, 40, 64, 104, 128]
    cu_seqlens = torch.tensor(starts, dtype=torch.int32, device=device)
    positions = torch.cat([torch.arange(40), torch.arange(24)]).repeat(2, 1).to(device)
    return {"input_ids": ids, "cu_seqlens": cu_seqlens, "position_ids": positions}


def loss_and_gradients(
    model: QwenLM, batch: dict, bf16: bool = False
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(logits, next-token loss, gradient per parameter) of one forward and backward pass."""
    model.zero_grad(set_to_none=True)
    autocast = torch.autocast(batch["input_ids"].device.type, dtype=torch.bfloat16)
    with autocast if bf16 else nullcontext():
        logits = model(**batch)
    ids = batch["input_ids"]
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    grads = {name: p.grad.float().clone() for name, p in model.named_parameters()}
    return logits.float().detach(), loss.detach(), grads


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def gradient_difference(a: dict, b: dict) -> float:
    """Relative difference of all gradients taken together."""
    return relative(torch.cat([a[n].flatten() for n in b]), torch.cat([b[n].flatten() for n in b]))


def row(check: str, model: str, value: float | None, tolerance: float | str) -> dict[str, str]:
    """A line of the report; `value` None: skipped, `tolerance` then the reason."""
    if value is None:
        return {"check": check, "model": model, "value": "-", "tolerance": "-",
                "verdict": f"skipped ({tolerance})"}  # fmt: skip
    verdict = "ok" if value <= tolerance else "FAILED"
    return {"check": check, "model": model, "value": f"{value:.2e}",
            "tolerance": f"<= {tolerance:.0e}", "verdict": verdict}  # fmt: skip


def vs_transformers(kind: str, device: torch.device) -> dict:
    import tempfile

    import transformers

    ours = build(kind, device, PYTORCH)
    with tempfile.TemporaryDirectory() as folder:
        ours.save_pretrained(folder)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).to(device)
    ids = token_batch(ours, device, packed=False)["input_ids"]
    with torch.no_grad():
        difference = (ours(ids) - theirs(input_ids=ids, use_cache=False).logits).abs().max()
    return row("vs transformers, fp32 logits (max abs)", kind, difference.item(), 1e-4)


def fused_kernels(device: torch.device) -> Kernels | None:
    """The installed kernels, allowed on fp32 CUDA tensors too (FlashAttention left out: it has
    no fp32 kernel); None without CUDA or without flash-linear-attention."""
    if device.type != "cuda":
        return None
    installed = installed_kernels()
    if installed.chunk_gated_delta_rule is None:
        return None
    return dataclasses.replace(installed, varlen_attn=None, eligible=lambda x: x.is_cuda)


def fused_vs_pytorch_fp32(device: torch.device, packed: bool) -> list[dict]:
    label = f"fused vs PyTorch, fp32, {'packed' if packed else 'unpacked'}"
    kernels = fused_kernels(device)
    if kernels is None:
        reason = "needs CUDA and flash-linear-attention; on CPU see make test-kernels"
        return [row(f"{label}: logits", "hybrid", None, reason)]
    fused, reference = build("hybrid", device, kernels), build("hybrid", device, PYTORCH)
    torch.manual_seed(1)
    batch = token_batch(reference, device, packed)
    logits, _, grads = loss_and_gradients(fused, batch)
    ref_logits, _, ref_grads = loss_and_gradients(reference, batch)
    grads_difference = gradient_difference(grads, ref_grads)
    return [
        row(f"{label}: logits (relative)", "hybrid", relative(logits, ref_logits), 1e-4),
        row(f"{label}: gradients (relative)", "hybrid", grads_difference, 1e-3),
    ]


def fused_vs_pytorch_bf16(kind: str, device: torch.device) -> dict:
    label = "fused vs PyTorch, bf16 autocast, packed: loss (relative)"
    if device.type != "cuda":
        return row(label, kind, None, "needs CUDA")
    fused, reference = build(kind, device), build(kind, device, PYTORCH)
    torch.manual_seed(1)
    batch = token_batch(reference, device, packed=True)
    _, loss, _ = loss_and_gradients(fused, batch, bf16=True)
    _, ref_loss, _ = loss_and_gradients(reference, batch, bf16=True)
    return row(label, kind, relative(loss, ref_loss), BF16_TOLERANCE)


class OnDevice(torch.nn.Module):
    """`model` on its device behind CPU inputs and outputs, as packing_checks builds them."""

    def __init__(self, model: QwenLM):
        super().__init__()
        self.model = model
        self.device = next(model.parameters()).device

    def forward(self, input_ids, **kwargs) -> torch.Tensor:
        moved = {k: v if v is None else v.to(self.device) for k, v in kwargs.items()}
        return self.model(input_ids.to(self.device), **moved).cpu()


def packed_vs_padded(kind: str, device: torch.device) -> list[dict]:
    model = build(kind, device, perturb=False)  # initialised as train.py does, as check_packing
    documents = random_documents(model.config.vocab_size, DEFAULT_LENGTHS)
    results = run_checks(OnDevice(model), documents, ROW_LENGTH)
    return [row(f"packed vs padded: {name}", kind, value, TOLERANCES[name])
            for name, value in results.items()]  # fmt: skip


def bf16_vs_fp32(device: torch.device) -> list[dict]:
    model = build("hybrid", device)
    torch.manual_seed(1)
    batch = token_batch(model, device, packed=True)
    logits32, loss32, grads32 = loss_and_gradients(model, batch)
    logits16, loss16, grads16 = loss_and_gradients(model, batch, bf16=True)
    flat32 = torch.cat([g.flatten() for g in grads32.values()]).double()  # fp32 sums of
    flat16 = torch.cat([grads16[n].flatten() for n in grads32]).double()  # squares drift
    misalignment = 1 - F.cosine_similarity(flat32, flat16, dim=0).item()
    return [
        row("bf16 vs fp32: logits (relative)", "hybrid", relative(logits16, logits32),
            BF16_TOLERANCE),
        row("bf16 vs fp32: loss (relative)", "hybrid", relative(loss16, loss32), BF16_TOLERANCE),
        row("bf16 vs fp32: 1 - gradient cosine", "hybrid", misalignment, BF16_MISALIGNMENT),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the layers' paths
    use_pytorch_kernels_in_transformers()
    checks: list[Callable[[], dict | list[dict]]] = [
        *(lambda k=k: vs_transformers(k, args.device) for k in MODELS),
        lambda: fused_vs_pytorch_fp32(args.device, packed=False),
        lambda: fused_vs_pytorch_fp32(args.device, packed=True),
        *(lambda k=k: fused_vs_pytorch_bf16(k, args.device) for k in MODELS),
        *(lambda k=k: packed_vs_padded(k, args.device) for k in MODELS),
        lambda: bf16_vs_fp32(args.device),
    ]
    rows = []
    for check in checks:
        result = check()
        rows += result if isinstance(result, list) else [result]
    report = "\n".join([machine_line(), f"Device: {args.device}", "", markdown(rows, COLUMNS)])
    publish(report, args.output)
    if any(r["verdict"] == "FAILED" for r in rows):
        sys.exit(1)
    return rows


if __name__ == "__main__":
    exit_in_one_line(main)()
