"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5, with its convolution.

The two differ only in their input projections: Qwen3-Next's are fused and grouped per key head
(`GatedDeltaNet`), Qwen3.5's are four plain ones (`SplitProjectionGatedDeltaNet`);
`gated_deltanet` builds the one a config's family has.

On a GPU, with `flash-linear-attention` and `causal-conv1d` installed, the chunked recurrence
and the convolution run as their fused kernels (given the document boundaries; `choose_kernels`
decides, from the layer's `kernels.Kernels`); everywhere else they run as the pure PyTorch code
of `delta_rule.py` and `ShortConvolution`, which honours the same boundaries.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from src.models.language.qwen.boundaries import DocumentBoundaries
from src.models.language.qwen.config import QwenConfig
from src.models.language.qwen.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from src.models.language.qwen.kernels import Kernels, causal_conv1d_fits, kernels_for
from src.models.language.qwen.layers import GatedRMSNorm

log = logging.getLogger(__name__)


@dataclass
class DeltaNetCache:
    """What a Gated DeltaNet layer carries from one decoding step to the next."""

    conv: torch.Tensor | None = None  # the last K-1 convolution inputs [B, K-1, channels]
    recurrent: torch.Tensor | None = None  # the state S [B, value_heads, d_k, d_v], fp32


class ShortConvolution(nn.Module):
    """Depthwise causal convolution over time (kernel K, no bias), then SiLU.

    out[t, c] = silu(sum_j weight[c, 0, j] * x[t - (K-1) + j, c]), where taps before the start
    of t's document read zeros. `weight` has nn.Conv1d's shape, as in the checkpoints.
    """

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))

    @property
    def kernel_size(self) -> int:
        return self.weight.shape[-1]

    def forward(
        self,
        x: torch.Tensor,
        boundaries: DocumentBoundaries | None = None,
        cache: DeltaNetCache | None = None,
        kernel: Callable | None = None,
    ) -> torch.Tensor:
        """`x` [B, T, channels] -> [B, T, channels]; with a cache, continue from its inputs.

        `kernel`: causal-conv1d's `causal_conv1d_fn` to run instead (no cache; x on a GPU in
        fp16/bf16, in a shape `kernels.causal_conv1d_fits`).
        """
        if kernel is not None:
            document_ids = None if boundaries is None else boundaries.document_ids.to(torch.int32)
            weight = self.weight.squeeze(1).to(x.dtype)
            out = kernel(x.transpose(1, 2), weight, seq_idx=document_ids, activation="silu")
            return out.transpose(1, 2)
        kernel_size = self.kernel_size
        batch, length, channels = x.shape
        history = None if cache is None else cache.conv
        if history is None:
            history = x.new_zeros(batch, kernel_size - 1, channels)
        padded = torch.cat((history.to(x.dtype), x), dim=1)  # [B, K-1+T, channels]
        if cache is not None:
            cache.conv = padded[:, length:]
        out = 0
        for j in range(kernel_size):
            tap = padded[:, j : j + length]  # tap j reads token t - lag
            lag = kernel_size - 1 - j
            if boundaries is not None and lag:
                tap = tap * (boundaries.position_in_document >= lag)[..., None]
            out = out + tap * self.weight[:, 0, j]
        return F.silu(out).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Token mixer of Qwen3-Next's "linear_attention" layers (Qwen3.5's: the subclass below).

    x -> in_proj_qkvz, grouped per key head as [q | k | v | z], and in_proj_ba as [b | a] ->
    short convolution + SiLU over [q; k; v] -> beta = sigmoid(b), g = -exp(A_log) *
    softplus(a + dt_bias) -> gated delta rule on L2-normalised q, k (q scaled by d_k^-0.5),
    each key head serving linear_num_value_heads / linear_num_key_heads value heads ->
    weight * rmsnorm(o) * silu(z) per value head -> out_proj.
    """

    def __init__(self, config: QwenConfig, layer_index: int, kernels: Kernels | None = None):
        super().__init__()
        self.layer_index = layer_index
        self.kernels = kernels  # None: the installed ones on a GPU (see kernels.kernels_for)
        self.num_key_heads = config.linear_num_key_heads
        self.num_value_heads = config.linear_num_value_heads
        self.key_head_dim = config.linear_key_head_dim
        self.value_head_dim = config.linear_value_head_dim
        self.chunk_size = config.linear_chunk_size
        self.key_dim = self.num_key_heads * self.key_head_dim
        self.value_dim = self.num_value_heads * self.value_head_dim
        hidden = config.hidden_size
        self._build_input_projections(hidden)
        conv_channels = 2 * self.key_dim + self.value_dim
        self.conv1d = ShortConvolution(conv_channels, config.linear_conv_kernel_dim)
        self.dt_bias = nn.Parameter(torch.ones(self.num_value_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_value_heads))
        self.norm = GatedRMSNorm(self.value_head_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        self._logged_path: str | None = None
        self.reset_parameters()

    def _build_input_projections(self, hidden: int) -> None:
        self.in_proj_qkvz = nn.Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden, 2 * self.num_value_heads, bias=False)

    def reset_parameters(self) -> None:
        """Qwen3-Next's gate init: dt_bias 1, A ~ U(0.01, 16) sampled in fp32 (never log 0)."""
        nn.init.ones_(self.dt_bias)
        with torch.no_grad():
            a = torch.empty(self.A_log.shape, dtype=torch.float32, device=self.A_log.device)
            self.A_log.copy_(a.uniform_(0.01, 16).log_())

    def forward(
        self,
        x: torch.Tensor,
        boundaries: DocumentBoundaries | None = None,
        cache: DeltaNetCache | None = None,
    ) -> torch.Tensor:
        qkv, z, b, a = self._project(x)
        kernels = kernels_for(qkv, self.kernels)
        conv_kernel, rule_kernel = choose_kernels(kernels, qkv, self.conv1d.kernel_size, cache)
        self._log_path(conv_kernel, rule_kernel, decoding=cache is not None)
        q, k, v = self.conv1d(qkv, boundaries, cache, conv_kernel).split(
            (self.key_dim, self.key_dim, self.value_dim), dim=-1
        )
        q = q.unflatten(-1, (self.num_key_heads, self.key_head_dim))
        k = k.unflatten(-1, (self.num_key_heads, self.key_head_dim))
        v = v.unflatten(-1, (self.num_value_heads, self.value_head_dim))
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # log-decay <= 0
        if rule_kernel is not None:
            o = self._fla_delta_rule(rule_kernel, q, k, v, g, beta, boundaries)
        else:
            o = self._torch_delta_rule(q, k, v, g, beta, boundaries, cache)
        z = z.unflatten(-1, (self.num_value_heads, self.value_head_dim))
        return self.out_proj(self.norm(o, z).flatten(2))  # o, z [B, T, value_heads, d_v]

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The convolution's input [q; k; v], then z, b and a, from in_proj_qkvz and in_proj_ba.

        [q; k; v] is [B, T, 2*key_dim + value_dim], z [B, T, value_dim], b and a
        [B, T, value_heads].

        The checkpoints group each projection's rows per key head, [q | k | v | z] and [b | a],
        where v, z, b and a cover the value heads that key head serves: the outputs are
        regrouped here, head-major, as transformers' model does.
        """
        per_key_head = self.num_value_heads // self.num_key_heads
        v_width = per_key_head * self.value_head_dim
        qkvz = self.in_proj_qkvz(x).unflatten(-1, (self.num_key_heads, -1))
        ba = self.in_proj_ba(x).unflatten(-1, (self.num_key_heads, -1))
        widths = (self.key_head_dim, self.key_head_dim, v_width, v_width)
        q, k, v, z = (part.flatten(-2) for part in qkvz.split(widths, dim=-1))
        b, a = (part.flatten(-2) for part in ba.split((per_key_head, per_key_head), dim=-1))
        return torch.cat([q, k, v], dim=-1), z, b, a

    def _torch_delta_rule(self, q, k, v, g, beta, boundaries, cache) -> torch.Tensor:
        q = _l2_normalise(q.float()) * self.key_head_dim**-0.5
        k = _l2_normalise(k.float())
        starts = None if boundaries is None else boundaries.starts
        state = None if cache is None else cache.recurrent
        # fp32 throughout, autocast or not: a low-precision state drifts along the sequence.
        with torch.autocast(q.device.type, enabled=False):
            if cache is not None and q.shape[1] == 1:
                o, state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state)
            else:
                o, state = chunk_gated_delta_rule(
                    q, k, v, g, beta, starts, initial_state=state, chunk_size=self.chunk_size
                )
        if cache is not None:
            cache.recurrent = state
        return o

    def _fla_delta_rule(self, rule, q, k, v, g, beta, boundaries) -> torch.Tensor:
        """Run flash-linear-attention's chunk kernel, which pairs heads as the PyTorch code does.

        Value head h reads key head h // (value heads / key heads).
        """
        batch, length = q.shape[:2]
        offsets = {}
        if boundaries is not None:  # fla takes packed documents as one row
            q, k, v, g, beta = (t.flatten(0, 1)[None] for t in (q, k, v, g, beta))
            # fla caches its chunk indices by tensor identity: the same tensors in every layer
            # reuse them, and the host copy spares the sync that computes them.
            offsets = {
                "cu_seqlens": boundaries.cu_seqlens_long,
                "cu_seqlens_cpu": boundaries.cu_seqlens_cpu,
            }
        o, _ = rule(
            q, k, v, g, beta,
            scale=self.key_head_dim**-0.5, use_qk_l2norm_in_kernel=True, **offsets,
        )  # fmt: skip
        return o.view(batch, length, *o.shape[2:])

    def _log_path(self, conv_kernel, rule_kernel, decoding: bool) -> None:
        if torch.compiler.is_compiling():  # a log call would split the compiled graph
            return
        conv = "PyTorch" if conv_kernel is None else "causal-conv1d kernel"
        if rule_kernel is not None:
            rule = "flash-linear-attention chunk kernel"
        elif decoding:
            rule = "PyTorch, one step per token after the prompt"
        else:
            rule = f"PyTorch, chunks of {self.chunk_size}"
        path = f"convolution by {conv}, delta rule by {rule}"
        if path != self._logged_path:
            log.info("Layer %d Gated DeltaNet: %s", self.layer_index, path)
            self._logged_path = path


class SplitProjectionGatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's Gated DeltaNet: the same layer, its inputs from four separate projections.

    in_proj_qkv gives [q; k; v] in the convolution's order, in_proj_z the output gate, in_proj_b
    and in_proj_a one value per value head: nothing to regroup.
    """

    def _build_input_projections(self, hidden: int) -> None:
        self.in_proj_qkv = nn.Linear(hidden, 2 * self.key_dim + self.value_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_value_heads, bias=False)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)


def gated_deltanet(
    config: QwenConfig, layer_index: int, kernels: Kernels | None = None
) -> GatedDeltaNet:
    """The Gated DeltaNet of `config`'s family: fused projections (Qwen3-Next) or split."""
    layer = GatedDeltaNet if config.fused_linear_projections else SplitProjectionGatedDeltaNet
    return layer(config, layer_index, kernels)


def choose_kernels(
    kernels: Kernels, qkv: torch.Tensor, kernel_size: int, cache: DeltaNetCache | None
) -> tuple[Callable | None, Callable | None]:
    """The causal-conv1d and flash-linear-attention functions this forward pass calls.

    Each is None where the pass runs PyTorch's code instead. Both need an eligible input (by
    default on CUDA in fp16/bf16) and a whole sequence (decoding steps carry a cache they cannot
    read); the convolution kernel also needs a shape it supports, checked (and a misfit logged)
    by `kernels.causal_conv1d_fits`.
    """
    if cache is not None or not kernels.eligible(qkv):
        return None, None
    conv = kernels.causal_conv1d_fn
    if conv is not None and not causal_conv1d_fits(qkv, kernel_size):
        conv = None
    return conv, kernels.chunk_gated_delta_rule


def _l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(sum(x^2) + eps)` over the last axis, as flash-linear-attention computes it."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
