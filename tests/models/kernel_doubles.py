"""Stand-ins for the CUDA-only kernels the Qwen layers call, for tests on CPU.

Each refuses what its kernel refuses (the checks of causal-conv1d's extension, the input contract
of torch's varlen_attn) with a `ContractViolation`, then computes the kernel's result with a
reference: the layer's own PyTorch convolution, and masked scaled_dot_product_attention. Passed in
a `Kernels` with `eligible=lambda x: True`, they run the layers' kernel branches on CPU;
`recorded` notes each call, so that a test knows which branches ran.
"""

import torch
import torch.nn.functional as F
from torch.func import functional_call

from src.models.language.qwen.boundaries import DocumentBoundaries
from src.models.language.qwen.deltanet import ShortConvolution

FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)


class ContractViolation(Exception):
    """An input the real kernel would reject (or silently misread)."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ContractViolation(message)


def recorded(name: str, kernel, calls: list):
    """`kernel`, appending `name` to `calls` each time it runs: which kernel branches ran."""

    def run(*args, **kwargs):
        calls.append(name)
        return kernel(*args, **kwargs)

    return run


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, activation=None):
    """causal-conv1d's `causal_conv1d_fn` for x [B, channels, T] read channel-last, weight
    [channels, width] and seq_idx [B, T]: taps that reach into another seq_idx read zero."""
    require(activation in ("silu", "swish"), f"activation {activation!r}: this stand-in is SiLU's")
    require(bias is None, "bias: the Qwen layers pass none, and this stand-in takes none")
    _check_conv_inputs(x, weight, seq_idx)
    conv = ShortConvolution(x.shape[1], weight.shape[1])
    boundaries = None if seq_idx is None else _boundaries(seq_idx)
    out = functional_call(conv, {"weight": weight[:, None]}, (x.transpose(1, 2), boundaries))
    return out.transpose(1, 2)  # channel-last, as the kernel's output is laid out like x


def _check_conv_inputs(x, weight, seq_idx) -> None:
    """The checks of causal_conv1d_fwd in the extension (csrc/causal_conv1d.cpp)."""
    require(x.ndim == 3 and weight.ndim == 2, f"x {list(x.shape)}, weight {list(weight.shape)}")
    batch, channels, length = x.shape
    width = weight.shape[1]
    require(weight.shape[0] == channels, f"weight {list(weight.shape)} for {channels} channels")
    require(x.dtype in FLOAT_TYPES and weight.dtype in FLOAT_TYPES, f"{x.dtype}, {weight.dtype}")
    require(2 <= width <= 4, f"width {width}: the kernel is compiled for 2 to 4")
    channel_last = x.stride(1) == 1 and x.stride(2) > 1
    require(channel_last or x.stride(2) == 1, f"x strides {x.stride()}: neither layout")
    if channel_last:
        require(channels % 8 == 0, f"{channels} channels, channel-last needs a multiple of 8")
        require(
            x.stride(0) % 8 == 0 and x.stride(2) % 8 == 0,
            f"x strides {x.stride()}: channel-last needs batch and time strides in multiples of 8",
        )
    if seq_idx is not None:
        require(channel_last, "seq_idx is only supported for channel-last x")
        require(seq_idx.dtype == torch.int32, f"seq_idx is {seq_idx.dtype}, not int32")
        require(seq_idx.is_contiguous(), "seq_idx is not contiguous")
        require(seq_idx.device == x.device, f"seq_idx on {seq_idx.device}, x on {x.device}")
        require(seq_idx.shape == (batch, length), f"seq_idx {list(seq_idx.shape)} for x [B, C, T]")


def _boundaries(seq_idx: torch.Tensor) -> DocumentBoundaries | None:
    """The documents of seq_idx [B, T]: runs of one index, each row starting a new one."""
    batch, length = seq_idx.shape
    starts = torch.ones_like(seq_idx, dtype=torch.bool)
    starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    offsets = starts.flatten().nonzero().flatten()
    cu_seqlens = torch.cat((offsets, offsets.new_tensor([batch * length])))
    return DocumentBoundaries.from_cu_seqlens(cu_seqlens.int(), batch, length)


def varlen_attn(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,
    scale=None, window_size=(-1, -1), enable_gqa=False,
):  # fmt: skip
    """torch.nn.attention.varlen.varlen_attn for self-attention over packed documents: q, k, v
    [total, heads, d], each document attending only to itself (causally for window (-1, 0))."""
    _check_varlen_inputs(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, enable_gqa)
    require(isinstance(window_size, tuple), f"window_size {window_size!r}: torch compares a tuple")
    require(window_size in ((-1, -1), (-1, 0)), f"window {window_size}: no sliding windows here")
    require(torch.equal(cu_seq_q, cu_seq_k), "this stand-in attends within the same documents")
    tokens = torch.arange(query.shape[0], device=query.device)
    document = torch.searchsorted(cu_seq_q[1:], tokens, right=True)
    mask = document[:, None] == document[None, :]
    if window_size == (-1, 0):
        mask = mask.tril()
    q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))  # [1, heads, total, d]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
    )
    return out[0].transpose(0, 1)


def _check_varlen_inputs(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, enable_gqa):
    """varlen_attn's documented input contract, and its head checks."""
    require(
        query.ndim == key.ndim == value.ndim == 3,
        f"q {list(query.shape)}, k {list(key.shape)}, v {list(value.shape)}: not [total, heads, d]",
    )
    require(query.dtype == key.dtype == value.dtype, "q, k and v differ in dtype")
    require(key.shape == value.shape and query.shape[2] == key.shape[2], "k, v or head_dim differ")
    heads, kv_heads = query.shape[1], key.shape[1]
    if enable_gqa:
        require(heads % kv_heads == 0, f"{heads} query heads for {kv_heads} key/value heads")
    else:
        require(heads == kv_heads, f"{heads} query heads, {kv_heads} key/value heads, no GQA")
    for name, cu, total, longest in (
        ("cu_seq_q", cu_seq_q, query.shape[0], max_q),
        ("cu_seq_k", cu_seq_k, key.shape[0], max_k),
    ):
        require(cu.dtype == torch.int32, f"{name} is {cu.dtype}, not int32")
        require(cu.ndim == 1 and cu.is_contiguous(), f"{name} is not a contiguous 1-D tensor")
        require(cu.device == query.device, f"{name} on {cu.device}, q on {query.device}")
        require(cu[0] == 0 and cu[-1] == total, f"{name} {cu.tolist()} for {total} tokens")
        require(type(longest) is int, f"max length {longest!r} is not an int")
        require(longest >= int(cu.diff().max()), f"max length {longest} below the longest")
