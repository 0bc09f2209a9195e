"""The decisions behind QwenLM's fused GPU paths, proved on CPU: half-precision weights, which
kernel runs for which config and library version, and what reaches the kernels."""

import logging

import pytest
import torch

from src.models.qwen import attention, deltanet, kernels
from src.models.qwen.attention import Attention
from src.models.qwen.boundaries import DocumentBoundaries
from src.models.qwen.deltanet import GatedDeltaNet
from src.models.qwen.kernels import causal_conv1d_fits, causal_conv1d_problem, usable_varlen_attn
from tests.helpers import max_difference, perturbed_model, tiny_config

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


def test_the_varlen_call_passes_a_causal_window_tuple_and_grouped_heads(monkeypatch):
    calls = []

    def recording_varlen_attn(*args, **kwargs):
        calls.append(kwargs)
        return args[0]

    monkeypatch.setattr(attention, "varlen_attn", recording_varlen_attn)
    layer = Attention(tiny_config("qwen3"), layer_index=0)
    boundaries = DocumentBoundaries.from_cu_seqlens(CU_SEQLENS, 2, 20)
    q, k = torch.randn(2, 4, 20, 16), torch.randn(2, 2, 20, 16)
    layer._attend_varlen(q, k, k, boundaries)
    window = calls[0]["window_size"]
    assert window == (-1, 0) and isinstance(window, tuple), f"window_size was {window!r}"
    assert calls[0]["enable_gqa"] is True, f"enable_gqa was {calls[0]['enable_gqa']!r}"


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ({}, None),  # 2*2*8 + 4*12 = 80 channels, width 4
        ({"linear_conv_kernel_dim": 2}, None),
        ({"linear_value_head_dim": 13}, "divisible by 8"),  # 84 channels
        ({"linear_conv_kernel_dim": 5}, "width"),
        ({"linear_conv_kernel_dim": 1}, "width"),
        # 80 channels, but rows of 80 + 48 + 2*6 = 140 elements: strides not multiples of 8
        ({"linear_num_value_heads": 6, "linear_value_head_dim": 8}, "stride"),
    ],
)
def test_causal_conv1d_is_used_only_for_shapes_its_kernel_supports(overrides, problem):
    layer = GatedDeltaNet(tiny_config("qwen3_next", **overrides), layer_index=0)
    qkv = layer._project(torch.randn(2, 5, 48))[0]
    found = causal_conv1d_problem(qkv, layer.conv1d.kernel_size)
    if problem is None:
        assert found is None, f"{overrides} refused: {found}"
    else:
        assert found is not None and problem in found, f"{overrides}: expected {problem!r}: {found}"


def test_an_unusable_causal_conv1d_shape_is_logged_once(caplog):
    x = torch.randn(2, 5, 84)
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        assert not causal_conv1d_fits(x, 4) and not causal_conv1d_fits(x, 4)
    assert len(caplog.records) == 1, f"logged {len(caplog.records)} times: {caplog.text!r}"


def test_every_gated_deltanet_layer_gets_the_same_int64_offsets(monkeypatch):
    seen = []

    def recording_fla_rule(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, cu_seqlens=None,
                           cu_seqlens_cpu=None):  # fmt: skip
        seen.append((cu_seqlens, cu_seqlens_cpu))
        return torch.zeros_like(v), None

    monkeypatch.setattr(deltanet, "fla_chunk_gated_delta_rule", recording_fla_rule)
    monkeypatch.setattr(deltanet, "choose_kernels", lambda *args: (False, True))
    model = perturbed_model(tiny_config("qwen3_next"))
    with torch.no_grad():
        model(token_ids(), cu_seqlens=CU_SEQLENS)
    assert len(seen) == 3, f"the chunk kernel ran in {len(seen)} layers, not the 3 DeltaNet ones"
    first, first_cpu = seen[0]
    assert all(offsets is first and cpu is first_cpu for offsets, cpu in seen), (
        "the layers received different offset tensors, so fla recomputes its chunk indices"
    )
    assert first.dtype == torch.int64 and torch.equal(first, CU_SEQLENS.long()), f"got {first}"
    assert first_cpu.device.type == "cpu" and torch.equal(first_cpu, CU_SEQLENS.long())
