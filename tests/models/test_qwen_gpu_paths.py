"""The decisions behind QwenLM's fused GPU paths, proved on CPU: half-precision weights, which
kernel runs for which config and library version, and what reaches the kernels: the layers'
kernel branches run against stand-ins that enforce the kernels' contracts."""

import logging

import pytest
import torch

from src.models.language.qwen import QwenLM, deltanet, kernels
from src.models.language.qwen.attention import grouped_sdpa, sdpa_expands_kv
from src.models.language.qwen.boundaries import DocumentBoundaries
from src.models.language.qwen.deltanet import GatedDeltaNet
from src.models.language.qwen.kernels import (
    PYTORCH,
    Kernels,
    causal_conv1d_fits,
    causal_conv1d_problem,
    kernels_for,
    usable_fla_rule,
    usable_varlen_attn,
)
from tests.helpers import perturbed_model, tiny_config
from tests.models.kernel_doubles import causal_conv1d_fn, recorded, varlen_attn
from tests.models.support import max_difference

# Two rows of 20 tokens holding four documents.
CU_SEQLENS = torch.tensor([0, 7, 20, 33, 40], dtype=torch.int32)


def token_ids(batch=2, length=20) -> torch.Tensor:
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_qwen3_next_runs_with_half_precision_weights_outside_autocast(dtype):
    reference = perturbed_model(tiny_config("qwen3_next"))
    model = perturbed_model(tiny_config("qwen3_next")).to(dtype)
    ids = token_ids()
    positions = DocumentBoundaries.from_cu_seqlens(CU_SEQLENS, 2, 20).position_in_document
    with torch.no_grad():
        for inputs in ({}, {"cu_seqlens": CU_SEQLENS, "position_ids": positions}):
            logits = model(ids, **inputs)
            expected = reference(ids, **inputs)
            assert logits.dtype == dtype, f"logits came back in {logits.dtype}, not {dtype}"
            difference = max_difference(logits.float(), expected)
            assert difference < 0.02, f"{dtype} logits {inputs.keys()} differ by {difference}"
    generated = model.generate(ids, max_new_tokens=3)
    assert generated.shape == (2, 23), f"generate returned shape {list(generated.shape)}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_delta_rule_returns_the_value_dtype_and_keeps_an_fp32_state(dtype):
    layer = GatedDeltaNet(tiny_config("qwen3_next"), layer_index=0)
    q, k = torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 8)
    v = torch.randn(2, 9, 4, 12, dtype=dtype)
    g, beta = -torch.rand(2, 9, 4), torch.rand(2, 9, 4, dtype=dtype)
    cache = deltanet.DeltaNetCache()
    out = layer._torch_delta_rule(q, k, v, g, beta, None, cache)
    assert out.dtype == dtype, f"the delta rule returned {out.dtype} for {dtype} values"
    assert cache.recurrent.dtype == torch.float32, f"the state is {cache.recurrent.dtype}"


def old_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False):
    """The signature of torch.nn.attention.varlen.varlen_attn before window_size and enable_gqa."""
    raise AssertionError("an unusable varlen_attn was called")


def new_varlen_attn(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False
):
    return query


def test_a_varlen_attn_without_window_size_or_enable_gqa_is_not_used(caplog):
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        assert usable_varlen_attn(old_varlen_attn) is None, "the old signature was accepted"
    assert "window_size" in caplog.text, f"the reason was not logged: {caplog.text!r}"
    assert usable_varlen_attn(new_varlen_attn) is new_varlen_attn, "the new one was refused"
    assert usable_varlen_attn(None) is None


def test_an_fla_release_before_0_6_is_not_used(caplog):
    def rule():
        pass

    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        assert usable_fla_rule(rule, "0.5.1") is None, "fla 0.5 was accepted"
    assert "fla-core>=0.6" in caplog.text, f"the reason was not logged: {caplog.text!r}"
    assert usable_fla_rule(rule, "0.6.0") is rule
    assert usable_fla_rule(rule, "0.10.0") is rule


def test_cpu_inputs_get_pytorch_code_without_importing_the_kernels(monkeypatch):
    def no_import():
        raise AssertionError("the installed kernels were imported for a CPU tensor")

    monkeypatch.setattr(kernels, "installed_kernels", no_import)
    x = torch.randn(2, 3, dtype=torch.bfloat16)
    assert kernels_for(x, None) is PYTORCH
    chosen = Kernels(eligible=lambda x: True)
    assert kernels_for(x, chosen) is chosen, "a model's own kernels were not used"


@pytest.mark.parametrize(
    ("device", "masked", "expands"),
    [("cuda", True, True), ("cuda", False, False), ("cpu", True, False), ("cpu", False, False)],
)
def test_masked_attention_on_cuda_expands_kv_instead_of_grouping(device, masked, expands):
    assert sdpa_expands_kv(device, masked) is expands, f"{device}, masked={masked}"


def test_expanded_and_grouped_kv_give_the_same_attention():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 20, 16, generator=generator)
    k, v = torch.randn(2, 2, 2, 26, 16, generator=generator)
    prefix_mask = torch.ones(20, 26, dtype=torch.bool).tril(6)  # 20 tokens after 6 cached ones
    packed_mask = DocumentBoundaries.from_cu_seqlens(CU_SEQLENS, 2, 20).attention_mask
    for mask, is_causal, keys in ((prefix_mask, False, 26), (packed_mask, False, 20),
                                  (None, True, 20)):  # fmt: skip
        k_seen, v_seen = k[:, :, :keys], v[:, :, :keys]
        grouped = grouped_sdpa(q, k_seen, v_seen, mask, is_causal, expand_kv=False)
        expanded = grouped_sdpa(q, k_seen, v_seen, mask, is_causal, expand_kv=True)
        difference = max_difference(grouped, expanded)
        assert difference < 1e-6, f"{keys} keys, causal={is_causal}: differ by {difference}"


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ({}, None),  # 2*2*8 + 4*12 = 80 channels, width 4
        ({"linear_conv_kernel_dim": 2}, None),
        ({"linear_value_head_dim": 13}, "divisible by 8"),  # 84 channels
        ({"linear_conv_kernel_dim": 5}, "width"),
        ({"linear_conv_kernel_dim": 1}, "width"),
        # 80 channels, regrouped out of projection rows of 80 + 48 + 2*6 = 140 elements into
        # rows of their own, so their strides are multiples of 8
        ({"linear_num_value_heads": 6, "linear_value_head_dim": 8}, None),
    ],
)
def test_causal_conv1d_is_used_only_for_shapes_its_kernel_supports(overrides, problem):
    layer = GatedDeltaNet(tiny_config("qwen3_next", **overrides), layer_index=0)
    qkv = layer._project(torch.randn(2, 5, 48))[0]
    found = causal_conv1d_problem(qkv, layer.conv1d.kernel_size)
    if problem is None:
        assert found is None, f"{overrides} refused: {found}"
    else:
        assert found is not None, f"{overrides}: expected {problem!r}: {found}"
        assert problem in found, f"{overrides}: expected {problem!r}: {found}"


def test_an_unusable_causal_conv1d_shape_is_logged_once(caplog):
    x = torch.randn(2, 5, 84)
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        assert not causal_conv1d_fits(x, 4)
        assert not causal_conv1d_fits(x, 4)
    assert len(caplog.records) == 1, f"logged {len(caplog.records)} times: {caplog.text!r}"


def test_every_gated_deltanet_layer_gets_the_same_int64_offsets():
    seen = []

    def recording_fla_rule(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, cu_seqlens=None,
                           cu_seqlens_cpu=None):  # fmt: skip
        seen.append((cu_seqlens, cu_seqlens_cpu))
        return torch.zeros_like(v), None

    fused = Kernels(chunk_gated_delta_rule=recording_fla_rule, eligible=lambda x: True)
    model = with_kernels(perturbed_model(tiny_config("qwen3_next")), fused)
    with torch.no_grad():
        model(token_ids(), cu_seqlens=CU_SEQLENS)
    assert len(seen) == 3, f"the chunk kernel ran in {len(seen)} layers, not the 3 DeltaNet ones"
    first, first_cpu = seen[0]
    assert all(offsets is first and cpu is first_cpu for offsets, cpu in seen), (
        "the layers received different offset tensors, so fla recomputes its chunk indices"
    )
    assert first.dtype == torch.int64, f"got {first}"
    assert torch.equal(first, CU_SEQLENS.long()), f"got {first}"
    assert first_cpu.device.type == "cpu"
    assert torch.equal(first_cpu, CU_SEQLENS.long())


def with_kernels(model: QwenLM, chosen: Kernels | None) -> QwenLM:
    """A copy of `model` whose layers call `chosen`."""
    copy = QwenLM(model.config, chosen)
    copy.load_state_dict(model.state_dict())
    return copy


def logits_and_gradients(model: QwenLM, **inputs) -> tuple[torch.Tensor, dict]:
    logits = model(token_ids(), **inputs)
    (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    return logits.detach(), {name: p.grad for name, p in model.named_parameters()}


def assert_same_results(expected, actual, where: str) -> None:
    """Logits within 1e-5, every gradient within 1e-4 relative: the decay gates' (A_log, dt_bias)
    sum terms of both signs over every token, so reordered rounding reaches 1e-5 there."""
    (logits, grads), (expected_logits, expected_grads) = actual, expected
    difference = max_difference(logits, expected_logits)
    assert difference < 1e-5, f"{where}: logits differ by {difference}"
    for name, grad in grads.items():
        error = ((grad - expected_grads[name]).norm() / expected_grads[name].norm()).item()
        assert error < 1e-4, f"{where}: the gradient of {name} differs by {error:.2e} (relative)"


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_the_kernel_branches_meet_the_kernels_contracts_and_match_pytorch(packed):
    calls = []
    stand_ins = Kernels(
        varlen_attn=recorded("varlen_attn", varlen_attn, calls),
        causal_conv1d_fn=recorded("causal_conv1d_fn", causal_conv1d_fn, calls),
        eligible=lambda x: True,
    )
    reference = perturbed_model(tiny_config("qwen3_next"))
    inputs = {"cu_seqlens": CU_SEQLENS} if packed else {}
    expected = logits_and_gradients(with_kernels(reference, PYTORCH), **inputs)
    actual = logits_and_gradients(with_kernels(reference, stand_ins), **inputs)
    assert_same_results(expected, actual, "packed" if packed else "unpacked")
    # varlen_attn serves packed rows only: one attention layer, after three DeltaNet ones.
    expected_calls = ["causal_conv1d_fn"] * 3 + (["varlen_attn"] if packed else [])
    assert calls == expected_calls, f"the kernels called were {calls}"


def test_a_convolution_the_kernel_cannot_run_falls_back_to_pytorch():
    calls = []
    conv = recorded("causal_conv1d_fn", causal_conv1d_fn, calls)
    stand_ins = Kernels(causal_conv1d_fn=conv, eligible=lambda x: True)
    reference = perturbed_model(tiny_config("qwen3_next", linear_value_head_dim=13))  # 84 channels
    expected = logits_and_gradients(with_kernels(reference, PYTORCH), cu_seqlens=CU_SEQLENS)
    actual = logits_and_gradients(with_kernels(reference, stand_ins), cu_seqlens=CU_SEQLENS)
    assert_same_results(expected, actual, "84 channels")
    assert calls == [], f"causal-conv1d ran on 84 channels: {calls}"
