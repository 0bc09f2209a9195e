"""flash-linear-attention's chunk kernel, run on CPU by Triton's interpreter: against the
project's chunked delta rule, then switched on in the GatedDeltaNet layer and a hybrid model
against their PyTorch paths, forward and backward.

TRITON_INTERPRET must be set before triton is imported, so the measurements below run in one
subprocess (`tests/models/triton_interpreter.py`) and the tests check what it reports. fp32 and fp16
only: the interpreter does not round bf16 arithmetic as a GPU does. The model also runs
causal-conv1d and varlen_attn, through the stand-ins of `tests/models/kernel_doubles.py`.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from src.models.language.qwen import QwenConfig, QwenLM
from src.models.language.qwen.boundaries import DocumentBoundaries
from src.models.language.qwen.delta_rule import chunk_gated_delta_rule
from src.models.language.qwen.deltanet import GatedDeltaNet
from src.models.language.qwen.kernels import PYTORCH, Kernels
from tests.models.kernel_doubles import causal_conv1d_fn, recorded, varlen_attn

pytestmark = [pytest.mark.kernels, pytest.mark.slow]

ROOT = Path(__file__).parents[2]
# Two rows of 75 tokens (fla's chunks are 64): documents start inside a chunk, one crosses
# the chunk boundary, and none is a multiple of the chunk length.
ROWS, LENGTH = 2, 75
CU_SEQLENS = [0, 7, 75, 80, 150]
OUT_TOLERANCE = {"float32": 1e-5, "float16": 1e-3}  # max abs difference
GRAD_TOLERANCE = {"float32": 1e-4, "float16": 3e-3}  # ||difference|| / ||gradient||
# The decay rates' gradients (A_log, dt_bias) in fp32: fla's own rounding. Heads that decay
# fast (A = exp(A_log) near 20 at the usual init, g = -A * softplus(a + dt_bias) about -25 a
# token) build cumulative log-decays near -1500 over fla's 64-token chunks, where fp32 values lie
# 1e-4 apart, and these gradients go through differences of such sums. Against an fp64 run of
# the PyTorch path, fla's are 4e-3 off in the layer (the PyTorch path's, in chunks of 16, 2e-6),
# and 1e-5 off once the decays are 20 times slower.
DECAY_RATES, DECAY_RATE_GRAD_TOLERANCE = ("A_log", "dt_bias"), 1e-2


@pytest.fixture(scope="module")
def measured() -> dict:
    """Each measurement function's report, from one interpreter subprocess."""
    names = ("delta_rule_errors", "layer_errors", "model_errors")
    targets = [f"{__name__}:{name}" for name in names]
    command = [sys.executable, "-m", "tests.models.triton_interpreter", *targets]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"the interpreter run failed:\n{result.stderr[-4000:]}"
    reports = json.loads(result.stdout.splitlines()[-1])
    return {target.split(":")[1]: report for target, report in reports.items()}


def assert_within_tolerance(cases: dict) -> None:
    for case, errors in cases.items():
        dtype = errors["dtype"]
        assert errors["out"] < OUT_TOLERANCE[dtype], f"{case}: outputs differ by {errors['out']}"
        for name, error in errors["grads"].items():
            decay_rate = name.split(".")[-1] in DECAY_RATES
            tolerance = DECAY_RATE_GRAD_TOLERANCE if decay_rate else GRAD_TOLERANCE[dtype]
            assert error < tolerance, f"{case}: the gradient of {name} differs by {error:.2e}"


def test_fla_computes_the_projects_delta_rule_forward_and_backward(measured):
    cases = measured["delta_rule_errors"]
    assert len(cases) == 6, f"cases measured: {sorted(cases)}"
    assert_within_tolerance(cases)


def test_the_gated_deltanet_layer_gives_the_same_results_with_fla(measured):
    cases = measured["layer_errors"]
    for case, errors in cases.items():
        assert errors["calls"] == ["chunk_gated_delta_rule"], f"{case}: ran {errors['calls']}"
    assert_within_tolerance(cases)


def test_the_hybrid_model_gives_the_same_results_on_its_kernel_path(measured):
    cases = measured["model_errors"]
    layer_kernels = ["causal_conv1d_fn", "chunk_gated_delta_rule"]
    assert cases["unpacked"]["calls"] == layer_kernels, cases["unpacked"]["calls"]
    assert cases["packed"]["calls"] == [*layer_kernels, "varlen_attn"], cases["packed"]["calls"]
    assert_within_tolerance(cases)


def test_importing_and_running_the_model_on_cpu_imports_no_kernel_package():
    code = (
        "import sys, torch\n"
        "from src.models.language.qwen import QwenConfig, QwenLM\n"
        "config = QwenConfig(model_type='qwen3_next', vocab_size=64, hidden_size=32, "
        "intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,"
        " head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,"
        " linear_value_head_dim=8)\n"
        "QwenLM(config)(torch.zeros(1, 5, dtype=torch.long))\n"
        "print(sorted(m for m in ('fla', 'causal_conv1d') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", f"imported on CPU: {result.stdout.strip()}"


# -- measured in the interpreter subprocess ------------------------------------------------------


def delta_rule_errors() -> dict:
    """fla's chunk_gated_delta_rule against `delta_rule.chunk_gated_delta_rule`, 4 value heads on
    2 key heads, unpacked rows and packed documents (offsets in int32 and int64)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule

    cases = {}
    for dtype in ("float32", "float16"):
        for offsets in (None, torch.int32, torch.int64):
            q, k, v, g, beta = delta_rule_inputs(getattr(torch, dtype), offsets is not None)
            scale, keywords, starts = q.shape[-1] ** -0.5, {}, None
            if offsets is not None:
                keywords["cu_seqlens"] = torch.tensor(CU_SEQLENS, dtype=offsets)
                starts = packed_boundaries().starts.view(1, -1)
            fla_out, _ = fla_rule(q, k, v, g, beta, scale=scale, **keywords)
            out, _ = chunk_gated_delta_rule(q * scale, k, v, g, beta, starts, chunk_size=16)
            cases[f"{dtype}, cu_seqlens {offsets}"] = {
                "dtype": dtype,
                "out": (fla_out.float() - out.float()).abs().max().item(),
                "grads": gradient_errors(
                    {"q": q, "k": k, "v": v, "g": g, "beta": beta}, fla_out, out
                ),
            }
    return cases


def delta_rule_inputs(dtype: torch.dtype, packed: bool) -> list[torch.Tensor]:
    """q, k [B, T, 2, 16] L2-normalised, v [B, T, 4, 16], g (log decay, fp32) and beta [B, T, 4],
    as leaves; one row of every token when packed."""
    generator = torch.Generator().manual_seed(0)
    batch, length = (1, ROWS * LENGTH) if packed else (ROWS, LENGTH)

    def randn(*shape):
        return torch.randn(batch, length, *shape, generator=generator)

    q, k = F.normalize(randn(2, 16), dim=-1), F.normalize(randn(2, 16), dim=-1)
    v, beta = randn(4, 16), torch.rand(batch, length, 4, generator=generator)
    g = -torch.rand(batch, length, 4, generator=generator)
    low = [t.to(dtype) for t in (q, k, v)] + [g, beta.to(dtype)]
    return [t.requires_grad_() for t in low]


def gradient_errors(leaves: dict, out_a, out_b) -> dict:
    """Relative difference ||grad_a - grad_b|| / ||grad_b|| of each leaf, for the loss
    sum(out * weights) (random weights make every output element count differently)."""
    weights = torch.randn(out_b.shape, generator=torch.Generator().manual_seed(1))
    grads_a = torch.autograd.grad((out_a.float() * weights).sum(), list(leaves.values()))
    grads_b = torch.autograd.grad((out_b.float() * weights).sum(), list(leaves.values()))
    return {
        name: ((a.float() - b.float()).norm() / b.float().norm()).item()
        for name, a, b in zip(leaves, grads_a, grads_b, strict=True)
    }


def hybrid_config(**overrides) -> QwenConfig:
    """Qwen3-Next with 2 key heads serving 4 value heads; 16 * 4 + 16 * 4 = 128 channels in the
    convolution, rows of 128 + 64 + 8: causal-conv1d's layout."""
    values = dict(
        model_type="qwen3_next", vocab_size=61, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_chunk_size=16, tie_word_embeddings=False,
    )  # fmt: skip
    return QwenConfig(**{**values, **overrides})


def kernel_path(calls: list, **stand_ins) -> Kernels:
    """fla's chunk kernel (and any `stand_ins`) for every tensor, each call recorded."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule

    chosen = {"chunk_gated_delta_rule": fla_rule, **stand_ins}
    recorded_kernels = {name: recorded(name, kernel, calls) for name, kernel in chosen.items()}
    return Kernels(**recorded_kernels, eligible=lambda x: True)


def perturbed(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with its norms, gates and decay rates off their initial values, so that no
    mix-up hides (as tests.helpers.perturbed_model, which would import Lightning here)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in module.parameters():
            if parameter.ndim == 1:
                parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    return module


def compared(fused, reference, inputs: dict, calls: list) -> dict:
    """Output and gradient differences of `fused` against `reference` (the same weights) on
    `inputs`, for the loss sum(out * weights), and the kernels that ran."""
    calls.clear()
    fused.zero_grad(), reference.zero_grad()
    out_fused, out_ref = fused(**inputs), reference(**inputs)
    weights = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(3))
    (out_fused * weights).sum().backward()
    (out_ref * weights).sum().backward()
    named = zip(fused.named_parameters(), reference.parameters(), strict=True)
    return {
        "dtype": "float32",
        "out": (out_fused - out_ref).abs().max().item(),
        "grads": {
            name: ((a.grad - b.grad).norm() / b.grad.norm()).item() for (name, a), b in named
        },
        "calls": list(calls),
    }


def packed_boundaries() -> DocumentBoundaries:
    return DocumentBoundaries.from_cu_seqlens(torch.tensor(CU_SEQLENS), ROWS, LENGTH)


def layer_errors() -> dict:
    """GatedDeltaNet with fla's kernel against its PyTorch path."""
    config, calls = hybrid_config(), []
    torch.manual_seed(0)
    reference = perturbed(GatedDeltaNet(config, 0, PYTORCH))
    with torch.no_grad():  # the convolution's weight starts uninitialised outside a QwenLM
        for weight in (p for p in reference.parameters() if p.ndim > 1):
            weight.normal_(std=0.1)
    fused = GatedDeltaNet(config, 0, kernel_path(calls))
    fused.load_state_dict(reference.state_dict())
    x = torch.randn(ROWS, LENGTH, config.hidden_size, generator=torch.Generator().manual_seed(2))
    return {
        "unpacked": compared(fused, reference, {"x": x}, calls),
        "packed": compared(fused, reference, {"x": x, "boundaries": packed_boundaries()}, calls),
    }


def model_errors() -> dict:
    """The 2-layer hybrid on its whole kernel path (fla, and causal-conv1d and varlen_attn as
    stand-ins) against its PyTorch path."""
    config, calls = hybrid_config(), []
    torch.manual_seed(0)
    reference = perturbed(QwenLM(config, PYTORCH))
    stand_ins = {"varlen_attn": varlen_attn, "causal_conv1d_fn": causal_conv1d_fn}
    fused = QwenLM(config, kernel_path(calls, **stand_ins))
    fused.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 61, (ROWS, LENGTH), generator=torch.Generator().manual_seed(4))
    cu_seqlens = torch.tensor(CU_SEQLENS, dtype=torch.int32)
    return {
        "unpacked": compared(fused, reference, {"input_ids": ids}, calls),
        "packed": compared(fused, reference, {"input_ids": ids, "cu_seqlens": cu_seqlens}, calls),
    }
