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
    """Qwen3-Next's RMSNorm: the gain is `1 + weight` (weight starts at 0, so weight decay pulls the
    gain towards 1), and the multiply happens in fp32 before the cast back."""

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gain = 1.0 + self.weight.float()
        return F.rms_norm(x.float(), (x.shape[-1],), gain, self.eps).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """The Gated DeltaNet's output norm: `weight * rmsnorm(o) * silu(z)`, per value head."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = super().forward(x)
        return (normed * F.silu(gate.float())).to(x.dtype)


def rotary_tables(
    position_ids: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cos` and `sin` [B, T, rotary_dim / 2] of the angles position * theta^(-2i/rotary_dim).

    Computed in fp32 from the positions, then cast to the activations' dtype.
    """
    exponents = torch.arange(0, rotary_dim, 2, device=position_ids.device).float() / rotary_dim
    inv_freq = 1.0 / (theta**exponents)  # [rotary_dim / 2]
    angles = position_ids[..., None].float() * inv_freq  # [B, T, rotary_dim / 2]
    return angles.cos().to(dtype), angles.sin().to(dtype)


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
