"""Causal self-attention: Qwen3's, and Qwen3-Next's / Qwen3.5's with a sigmoid output gate."""

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from src.models.language.qwen.boundaries import DocumentBoundaries
from src.models.language.qwen.config import QwenConfig
from src.models.language.qwen.kernels import Kernels, kernels_for
from src.models.language.qwen.layers import RMSNorm, ZeroCentredRMSNorm, apply_rotary

log = logging.getLogger(__name__)


@dataclass
class KVCache:
    """Keys and values [B, kv_heads, T_seen, head_dim] of the tokens an attention layer has seen."""

    key: torch.Tensor | None = None
    value: torch.Tensor | None = None

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.key is not None:
            assert self.value is not None, "key and value are cached together"
            key = torch.cat((self.key, key), dim=2)
            value = torch.cat((self.value, value), dim=2)
        self.key, self.value = key, value
        return key, value


class Attention(nn.Module):
    """Grouped-query attention with per-head q/k RMSNorm applied before RoPE.

    With `config.gated_attention` (Qwen3-Next, Qwen3.5) q_proj is twice as wide, holding per
    head [query | gate], and the output is multiplied by sigmoid(gate); with
    `config.zero_centred_norms` the q/k norms are zero-centred. RoPE may cover only part of each
    head (`partial_rotary_factor`).
    """

    def __init__(self, config: QwenConfig, layer_index: int, kernels: Kernels | None = None):
        super().__init__()
        self.kernels = kernels  # None: the installed ones on a GPU (see kernels.kernels_for)
        hidden, bias = config.hidden_size, config.attention_bias
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.gated = config.gated_attention
        q_width = self.num_heads * self.head_dim * (2 if self.gated else 1)
        kv_width = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_width, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_width, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_width, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        norm = ZeroCentredRMSNorm if config.zero_centred_norms else RMSNorm
        self.q_norm = norm(self.head_dim, config.rms_norm_eps)
        self.k_norm = norm(self.head_dim, config.rms_norm_eps)
        self._logged_path: str | None = None

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        boundaries: DocumentBoundaries | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v, gate = self._project(x)
        q = apply_rotary(self.q_norm(q), *rotary).transpose(1, 2)  # [B, heads, T, head_dim]
        k = apply_rotary(self.k_norm(k), *rotary).transpose(1, 2)  # [B, kv_heads, T, head_dim]
        v = v.transpose(1, 2)
        if cache is not None:
            k, v = cache.append(k, v)
        out = self._attend(q, k, v, boundaries).reshape(batch, length, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def _project(self, x: torch.Tensor):
        """Project x to the queries, keys, values and output gate.

        `q` [B, T, heads, d], `k` and `v` [B, T, kv_heads, d], and the output gate [B, T, heads*d]
        (None for Qwen3).
        """
        q = self.q_proj(x).unflatten(-1, (self.num_heads, -1))
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if not self.gated:
            return q, k, v, None
        q, gate = q.split(self.head_dim, dim=-1)  # per head: [query | gate]
        return q, k, v, gate.flatten(-2)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        boundaries: DocumentBoundaries | None,
    ) -> torch.Tensor:
        """Causal attention softmax(q k^T / sqrt(d) + mask) v, as [B, T, heads, d].

        When `boundaries` are given, each query also attends only within its own document.
        """
        kernels = kernels_for(q, self.kernels)
        if boundaries is not None and (dtype := _varlen_dtype(q, kernels)) is not None:
            self._log_path("FlashAttention varlen over the packed documents")
            return self._attend_varlen(
                kernels.varlen_attn, q.to(dtype), k.to(dtype), v.to(dtype), boundaries
            )
        length, seen = q.shape[2], k.shape[2]
        mask, is_causal = None, False
        if boundaries is not None:
            self._log_path("scaled_dot_product_attention, block-diagonal causal mask")
            mask = boundaries.attention_mask
        elif length == seen:
            self._log_path("scaled_dot_product_attention, causal")
            is_causal = True
        elif length > 1:  # new tokens after a cached prefix: query t sees keys up to seen-length+t
            mask = torch.ones(length, seen, dtype=torch.bool, device=q.device).tril(seen - length)
        expand = sdpa_expands_kv(q.device.type, masked=mask is not None)
        return grouped_sdpa(q, k, v, mask, is_causal, expand).transpose(1, 2)

    def _attend_varlen(self, varlen_attn, q, k, v, boundaries: DocumentBoundaries) -> torch.Tensor:
        batch, heads, length, head_dim = q.shape

        def tokens_first(t: torch.Tensor) -> torch.Tensor:  # [B, h, T, d] -> [B*T, h, d]
            return t.transpose(1, 2).reshape(batch * length, t.shape[1], head_dim)

        cu, longest = boundaries.cu_seqlens, boundaries.max_seqlen
        out = varlen_attn(
            *map(tokens_first, (q, k, v)), cu, cu, longest, longest,
            window_size=(-1, 0), enable_gqa=True,
        )  # fmt: skip
        return out.view(batch, length, heads, head_dim)

    def _log_path(self, path: str) -> None:
        if torch.compiler.is_compiling():  # a log call would split the compiled graph
            return
        if path != self._logged_path:
            log.info("Layer %d attention: %s", self.layer_index, path)
            self._logged_path = path


def _varlen_dtype(q: torch.Tensor, kernels: Kernels) -> torch.dtype | None:
    """The precision to run FlashAttention's varlen kernel in, or None where it cannot run.

    The precision is the autocast dtype, since the kernel is not autocast-aware itself, else q's.
    It cannot run with no varlen_attn in `kernels` (see `kernels.usable_varlen_attn`), or with q
    not eligible (not on CUDA, fp32 outside autocast).
    """
    if kernels.varlen_attn is None or not kernels.eligible(q):
        return None
    if torch.is_autocast_enabled(q.device.type):
        return torch.get_autocast_dtype(q.device.type)
    return q.dtype


def sdpa_expands_kv(device_type: str, masked: bool) -> bool:
    """Whether scaled_dot_product_attention gets k and v repeated per query head, not enable_gqa.

    On CUDA, grouped heads run fused only in the flash kernel, which takes no mask, and the
    memory-efficient kernel takes a mask but not grouped heads: a masked call with enable_gqa
    falls back to the math kernel, which holds B x heads x T x T scores. transformers expands
    in that case too. Elsewhere enable_gqa costs nothing.
    """
    return masked and device_type == "cuda"


def grouped_sdpa(q, k, v, mask, is_causal: bool, expand_kv: bool) -> torch.Tensor:
    """scaled_dot_product_attention of q [B, heads, T, d] over k, v [B, kv_heads, S, d].

    Each kv head serves heads / kv_heads consecutive query heads; `expand_kv` repeats them first.
    """
    if expand_kv:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=not expand_kv
    )
