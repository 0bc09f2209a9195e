"""The mixture-of-experts MLP of Qwen3-MoE, Qwen3-Next and Qwen3.5-MoE, and its auxiliary loss.

Reading order: `Router` (which k experts each token goes to, and with what weight), `Experts`
(the experts' SwiGLU MLPs), `SparseMoeBlock` (router + experts, plus Qwen3-Next's gated shared
expert), then `load_balancing_loss` and `expert_load`. Parameter names are transformers 5's
in-memory ones (`gate.weight`, `experts.gate_up_proj`, `experts.down_proj`, `shared_expert.*`,
`shared_expert_gate.weight`), so state dicts map one to one.

The experts run as two `torch.nn.functional.grouped_mm` calls (through `grouped_mm.py`, which
lets torch.compile trace them in float32) over all (token, choice) pairs
sorted by expert: one kernel for all experts instead of a Python loop over them, with the group
sizes kept on the device, so nothing waits for the host (no `.item()`, `nonzero()` or boolean
indexing) and the GPU never idles between experts.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from src.models.language.qwen.grouped_mm import grouped_mm
from src.models.language.qwen.layers import MLP

# What grouped_mm has kernels for; fp64 has none.
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def count_tokens(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many (token, choice) pairs of `indices` [N, k] go to each expert: [num_experts] long.

    A scatter-add of ones: its size is fixed by `num_experts`, so unlike `bincount` (which reads
    the largest index on the host) it needs no host sync, and integer sums do not depend on order.
    """
    flat = indices.flatten()
    counts = torch.zeros(num_experts, dtype=torch.long, device=indices.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


class Router(nn.Module):
    """Top-k softmax router: for each token, its k experts and their weights."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, normalise: bool):
        super().__init__()
        self.top_k = top_k
        self.normalise = normalise  # transformers' norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Draw the weight from N(0, std), as transformers' Qwen MoE models initialise it."""
        nn.init.normal_(self.weight, std=std)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route x [N, hidden]: logits [N, E], weights [N, k] (logits' dtype), indices [N, k]."""
        logits = F.linear(x, self.weight)
        # The softmax runs in fp32 so that bf16 logits still rank and weigh experts finely.
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        weights, indices = probs.topk(self.top_k, dim=-1)
        if self.normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), indices


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts run in: under autocast the GPU's autocast dtype, fp32 on a CPU.

    Without autocast it is x's, which must be fp32, bf16 or fp16. grouped_mm is not
    autocast-aware itself; on a GPU the experts follow autocast as nn.Linear would. On a CPU they
    run in fp32, as transformers' do: there each bf16 group size is a new oneDNN matmul, and a
    step's ~1,600 of them overflow oneDNN's cache of 1,024, so that bf16 experts made a
    bf16-mixed step 0.68x as fast as transformers' (1.03x with fp32 experts, scripts/bench_moe.py).
    """
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        dtype = x.dtype
    elif device_type == "cpu":
        dtype = torch.float32
    else:
        dtype = torch.get_autocast_dtype(device_type)
    if dtype not in GROUPED_MM_DTYPES:
        raise TypeError(
            f"Experts run with grouped_mm, which supports float32, bfloat16 and float16, "
            f"not {dtype}"
        )
    return dtype


class Experts(nn.Module):
    """`num_experts` SwiGLU MLPs in two stacked weights, each projection one grouped_mm.

    `gate_up_proj` [E, 2 * I, hidden] holds each expert's gate rows, then its up rows;
    `down_proj` is [E, hidden, I]. Both are in nn.Linear's [out, in] layout, as in transformers.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int):
        super().__init__()
        # grouped_mm wants every row to span a multiple of 16 bytes: 8 elements of bf16 or fp16.
        if hidden_size % 8 or intermediate_size % 8:
            raise ValueError(
                "grouped_mm needs hidden_size and moe_intermediate_size to be multiples of 8, "
                f"got {hidden_size} and {intermediate_size}"
            )
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Draw both weights from N(0, std), as transformers' Qwen MoE models initialise them."""
        nn.init.normal_(self.gate_up_proj, std=std)
        nn.init.normal_(self.down_proj, std=std)

    def forward(
        self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Sum over each token's k choices of weight * expert(x): x [N, hidden] -> [N, hidden].

        Runs in `compute_dtype(x)`.
        """
        dtype = compute_dtype(x)
        top_k = indices.shape[-1]

        # Sort the N * k (token, choice) pairs by expert; stable, so each group keeps token order.
        order = indices.flatten().sort(stable=True).indices  # pair number, in sorted order
        offs = count_tokens(indices, self.num_experts).cumsum(0).to(torch.int32)  # group ends
        rows = x.to(dtype)[order // top_k]  # pair p belongs to token p // k

        # Each expert's SwiGLU on its group of rows; the weights go in as [E, in, out] views.
        gate_up = grouped_mm(rows, self.gate_up_proj.to(dtype).transpose(1, 2), offs)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        out = grouped_mm(hidden, self.down_proj.to(dtype).transpose(1, 2), offs)
        out = out * weights.flatten()[order, None].to(dtype)

        # Back to pair order, then sum each token's k rows: deterministic on every device,
        # unlike an index_add of duplicate token rows, and accumulated in fp32 for half dtypes.
        # In backward the index_copy gathers a fresh dense gradient, whatever arrives: grouped_mm's
        # backward rejects, say, the zero-stride one of out.sum().
        out = torch.zeros_like(out).index_copy(0, order, out)
        return out.view(-1, top_k, out.shape[-1]).sum(dim=1)


@dataclass
class Routing:
    """What one forward of a SparseMoeBlock routed, for the auxiliary loss and the logs."""

    router_logits: torch.Tensor  # [B * T, E], with its graph, for `load_balancing_loss`
    tokens_per_expert: torch.Tensor  # [E] long, detached, for `expert_load`


class SparseMoeBlock(nn.Module):
    """The MoE MLP: routed experts, plus sigmoid(shared_expert_gate(x)) * shared_expert(x).

    The shared expert exists when `shared_expert_intermediate_size` > 0 (Qwen3-Next, Qwen3.5-MoE),
    not for Qwen3-MoE. Each forward stores its `Routing` in `last_routing`, replacing the previous
    one; it holds the router's graph until the next forward or until it is set to None.
    """

    last_routing: Routing | None = None

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        num_experts: int,
        num_experts_per_tok: int,
        norm_topk_prob: bool,
        shared_expert_intermediate_size: int = 0,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.gate = Router(hidden_size, num_experts, num_experts_per_tok, norm_topk_prob)
        self.experts = Experts(hidden_size, moe_intermediate_size, num_experts)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_expert_intermediate_size > 0:
            self.shared_expert = MLP(hidden_size, shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Mix x [B, T, hidden] -> [B, T, hidden], each token routed on its own."""
        batch, length, hidden_size = x.shape
        x = x.reshape(-1, hidden_size)
        logits, weights, indices = self.gate(x)
        out = self.experts(x, indices, weights)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        counts = count_tokens(indices, self.num_experts)
        self.last_routing = Routing(router_logits=logits, tokens_per_expert=counts)
        return out.view(batch, length, hidden_size)

    def __getstate__(self) -> dict:
        """Copies and pickles leave out the last forward's routing, whose graph cannot be copied."""
        state = dict(self.__dict__)
        state.pop("last_routing", None)
        return state

    @property
    def router_logits(self) -> torch.Tensor:
        """The last forward's router logits [B * T, E], with their graph."""
        assert self.last_routing is not None, "no forward has run yet"
        return self.last_routing.router_logits

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """The last forward's (token, choice) count per expert [E], detached."""
        assert self.last_routing is not None, "no forward has run yet"
        return self.last_routing.tokens_per_expert


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int
) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, as transformers' `load_balancing_loss_func` has it.

    num_experts * sum_e f_e * P_e, where f_e is the fraction of (token, choice) pairs sent to
    expert e and P_e its mean router probability, both taken over the rows of all layers at once
    (so the layers' statistics are pooled, not their losses summed). Every row counts: packed
    rows carry no padding mask, so this is transformers' loss with `attention_mask=None`. The
    softmax runs in fp32 (transformers' in the logits' dtype; the same for fp32 logits), which
    makes the top-k the router's own. No host sync.
    """
    if not router_logits:
        raise ValueError("load_balancing_loss needs the router logits of at least one layer")
    device = router_logits[0].device
    chosen = torch.zeros(num_experts, dtype=torch.long, device=device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = 0
    for logits in router_logits:
        probs = logits.to(device).softmax(dim=-1, dtype=torch.float32)
        chosen = chosen + count_tokens(probs.topk(top_k, dim=-1).indices, num_experts)
        prob_sum = prob_sum + probs.sum(dim=0)
        rows += probs.shape[0]
    return num_experts * torch.sum((chosen / rows) * (prob_sum / rows))


def expert_load(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """The busiest expert's count over the mean count, 1 when balanced: moe/load_max_over_mean."""
    counts = tokens_per_expert.float()
    return counts.max() / counts.mean()
