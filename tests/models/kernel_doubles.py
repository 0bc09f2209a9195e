"""Stand-ins for the CUDA-only kernels the Qwen layers call, for tests on CPU.

Each refuses what its kernel refuses (the checks of causal-conv1d's extension, the input contract
of torch's varlen_attn) with a `ContractViolation`, then computes the kernel's result from the
kernel's own contract, with none of the project's code: a depthwise `conv1d` of each document
zero-padded on its left, and masked scaled_dot_product_attention. Passed in a `Kernels` with
`eligible=lambda x: True`, they run the layers' kernel branches on CPU; `recorded` notes each
call, so that a test knows which branches ran.
"""

import torch
import torch.nn.functional as F

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
    [channels, width] and seq_idx [B, T]: out[b, c, t] = silu(sum_j weight[c, j] *
    x[b, c, t - (width - 1) + j]), where taps before the row's start or in another seq_idx read
    zero. Each run of one seq_idx is convolved alone, which is the same as long as no index comes
    back after another (the layers number documents in order); in fp32, as the kernel computes."""
    require(activation in ("silu", "swish"), f"activation {activation!r}: this stand-in is SiLU's")
    require(bias is None, "bias: the Qwen layers pass none, and this stand-in takes none")
    _check_conv_inputs(x, weight, seq_idx)
    batch, channels, length = x.shape
    width = weight.shape[1]
    filters = weight.float()[:, None]  # [channels, 1, width]: one filter per channel
    rows = []
    for row in range(batch):
        lengths = [length] if seq_idx is None else _run_lengths(seq_idx[row])
        documents = x[row].float().split(lengths, dim=-1)  # each [channels, its length]
        convolved = [
            F.conv1d(F.pad(document, (width - 1, 0)), filters, groups=channels)
            for document in documents
        ]
        rows.append(torch.cat(convolved, dim=-1))
    out = F.silu(torch.stack(rows)).to(x.dtype)
    return torch.empty_like(x).copy_(out)  # laid out like x, as the kernel's output is


def _run_lengths(ids: torch.Tensor) -> list[int]:
    """The lengths of the runs of one value in the 1-D `ids`, in order."""
    return torch.unique_consecutive(ids, return_counts=True)[1].tolist()


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
