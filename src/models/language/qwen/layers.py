"""The small pieces every Qwen layer shares: three RMSNorms, rotary embeddings, the SwiGLU MLP."""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalise in fp32, cast back to the input dtype, then scale by `weight`.

    The order (cast, then multiply) is Qwen3's; it matters only below fp32.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class ZeroCentredRMSNorm(RMSNorm):
    """Qwen3-Next's RMSNorm: the gain is `1 + weight`, multiplied in fp32 before the cast back.

    The weight starts at 0, so weight decay pulls the gain towards 1.
    """

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gain = 1.0 + self.weight.float()
        return F.rms_norm(x.float(), (x.shape[-1],), gain, self.eps).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """The Gated DeltaNet's output norm: `weight * rmsnorm(o) * silu(z)`, per value head."""

    def forward(  # type: ignore[override]  # an RMSNorm for its weight and init, plus a gate
        self, x: torch.Tensor, gate: torch.Tensor
    ) -> torch.Tensor:
        normed = super().forward(x)
        return (normed * F.silu(gate.float())).to(x.dtype)


def rotary_tables(
    position_ids: torch.Tensor,
    rotary_dim: int,
    theta: float,
    dtype: torch.dtype,
    mrope_section: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cos` and `sin` [B, T, rotary_dim / 2] of the angles position * theta^(-2i/rotary_dim).

    position_ids are [B, T], or with `mrope_section` (Qwen3.5's multimodal RoPE) also
    [3, B, T]: temporal, height and width positions, of which frequency i reads the one that
    `mrope_streams` gives it. Computed in fp32 from the positions, then cast to the activations'
    dtype.
    """
    exponents = torch.arange(0, rotary_dim, 2, device=position_ids.device).float() / rotary_dim
    inv_freq = 1.0 / (theta**exponents)  # [rotary_dim / 2]
    angles = position_ids[..., None].float() * inv_freq  # [(3,) B, T, rotary_dim / 2]
    if position_ids.ndim == 3:
        assert mrope_section is not None, "QwenLM.forward takes [3, B, T] positions for mrope only"
        half = inv_freq.shape[0]
        streams = mrope_streams(mrope_section, half).to(angles.device)
        angles = angles.movedim(0, -1)[..., torch.arange(half, device=angles.device), streams]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def mrope_streams(mrope_section: list[int], frequencies: int) -> torch.Tensor:
    """Which position stream (0 temporal, 1 height, 2 width) each rotary frequency reads.

    Interleaved as transformers' Qwen3.5 does: frequencies 1, 4, 7, ... (the first
    mrope_section[1] of them) read the height, 2, 5, 8, ... (mrope_section[2]) the width, the
    rest the temporal position, so that every stream spans low and high frequencies.
    """
    streams = torch.zeros(frequencies, dtype=torch.long)
    for stream in (1, 2):
        streams[stream : 3 * mrope_section[stream] : 3] = stream
    return streams


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the half-split ("NeoX") convention on x [B, T, heads, head_dim].

    Frequency i rotates the pair (x[i], x[i + rotary_dim/2]), rotary_dim = 2 * cos.shape[-1];
    dimensions past rotary_dim (Qwen3-Next's partial rotary) pass through unchanged.
    """
    half = cos.shape[-1]
    cos, sin = cos[:, :, None], sin[:, :, None]  # broadcast over heads
    first, second, passed = x.split((half, half, x.shape[-1] - 2 * half), dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin, passed), dim=-1)


class MLP(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
