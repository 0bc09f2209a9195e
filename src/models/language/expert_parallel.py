"""A mixture of experts' experts run by the ranks of an expert-parallel group, tokens sent to them.

The device mesh is ("expert_data_parallel", "expert_parallel", "tensor_parallel") of sizes
(G, N, 1): W = G * N data-parallel ranks, each group of N consecutive ones (an "expert_parallel"
group) running all E experts between them, E / N each.

Storage is FSDP2's: each stacked weight [E, out, in] is a DTensor sharded on dim 0 over all W
ranks, E / W whole experts each, on the mesh every other weight lives on, so gradient norms,
clipping, optimizer states and checkpoints see nothing new. A forward:

1. gathers, over its "expert_data_parallel" group (no-op when G = 1), the G shards of the
   experts this rank runs (those of the ranks at its place in the other groups); the backward
   reduce-scatters their gradients back and averages them over the W ranks, as FSDP does;
2. sorts the (token, choice) rows by the rank that runs their expert and exchanges the
   per-expert counts with one `all_to_all_single`;
3. dispatch: one `all_to_all_single` of the rows, with the split sizes the counts give;
4. runs its experts on what arrived, grouped by expert, with grouped_mm;
5. combine: the reverse `all_to_all_single` returns each result to the rank it came from,
   which weighs and sums each token's k rows as `Experts` does.

The row exchanges are autograd's (`all_to_all_single_autograd`): the backward sends the
gradients back the same way.
"""

from typing import Any, cast

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from src.models.language.qwen.grouped_mm import grouped_mm
from src.models.language.qwen.moe import Experts, compute_dtype, count_tokens

EXPERT_MESH_DIMS = ("expert_data_parallel", "expert_parallel", "tensor_parallel")


def data_parallel_mesh(device_mesh: DeviceMesh) -> DeviceMesh:
    """The ranks that split the batch, as one dimension: "data_parallel" or both expert dims."""
    if device_mesh.mesh_dim_names == EXPERT_MESH_DIMS:
        return device_mesh["expert_data_parallel", "expert_parallel"]._flatten("data_parallel")
    return device_mesh["data_parallel"]


class ExpertParallelExperts(nn.Module):
    """`Experts` over an expert-parallel mesh: the same forward, each rank running E / N experts.

    The weights keep `Experts`' names and global shapes, so state-dict keys and gathered
    checkpoints are unchanged. `last_dispatched_bytes` is what the last forward sent to the
    other ranks of its group: the rows it dispatched to experts run elsewhere plus the results
    it returned to the ranks they came from (not the rows kept on this rank, the per-expert
    counts, the experts' gather or the backward's gradients). A host integer: the split sizes
    are on the host already.
    """

    gate_up_proj: nn.Parameter  # DTensors, set in __init__
    down_proj: nn.Parameter
    slots: torch.Tensor

    def __init__(self, experts: Experts, device_mesh: DeviceMesh):
        super().__init__()
        self.num_experts = experts.num_experts
        self.expert_group = device_mesh["expert_parallel"].get_group()
        self.gather_group = device_mesh["expert_data_parallel"].get_group()
        storage = data_parallel_mesh(device_mesh)
        self.data_parallel_size = storage.size()
        self.last_dispatched_bytes = 0
        # Every rank built the same weights; rank 0's are scattered so that they agree anyway.
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(experts, name)
            sharded = distribute_tensor(weight.detach(), storage, [Shard(0)])
            setattr(self, name, nn.Parameter(sharded, requires_grad=weight.requires_grad))
        self.register_buffer("slots", self._slots(device_mesh), persistent=False)

    def _slots(self, device_mesh: DeviceMesh) -> torch.Tensor:
        """slots[e]: expert e's place in the order of the ranks that run them, rank-major.

        Storage rank d = g * N + r holds experts d * s to d * s + s - 1 (s = E / W), and
        "expert_parallel" rank r runs the shards of ranks r, N + r, 2N + r, ...: expert e is the
        (g * s + e % s)-th of rank r's E / N. The identity when G = 1.
        """
        ranks = device_mesh["expert_parallel"].size()
        per_shard = self.num_experts // self.data_parallel_size
        expert = torch.arange(self.num_experts)
        shard, within = expert // per_shard, expert % per_shard
        runner, gathered = shard % ranks, shard // ranks
        return runner * (self.num_experts // ranks) + gathered * per_shard + within

    def forward(
        self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Sum over each token's k choices of weight * expert(x): x [N, hidden] -> [N, hidden]."""
        dtype = compute_dtype(x)
        ranks = self.expert_group.size()
        top_k, hidden, local = indices.shape[-1], x.shape[-1], self.num_experts // ranks

        slots = self.slots[indices]  # [N, k]: by the rank that runs them
        order = slots.flatten().sort(stable=True).indices  # pair number, in sorted order
        counts = count_tokens(slots, self.num_experts)  # [E]: rows for each slot
        # arrived[s * local + l]: the rows rank s sends to this rank's l-th expert.
        arrived = funcol.all_to_all_single(counts, None, None, self.expert_group)
        arrived = funcol.wait_tensor(arrived)
        per_rank = torch.stack([counts.view(ranks, -1).sum(1), arrived.view(ranks, -1).sum(1)])
        send, receive = per_rank.tolist()  # all_to_all_single takes its splits on the host

        rows = x.to(dtype)[order // top_k]  # pair p belongs to token p // k
        received = exchange(rows, receive, send, self.expert_group)  # by sender, then expert
        results = self._run_experts(received, arrived.view(ranks, local), dtype)
        out = exchange(results, send, receive, self.expert_group)  # in sorted pair order
        out = out * weights.flatten()[order, None].to(dtype)

        me = self.expert_group.rank()
        sent_rows = sum(send) - send[me] + sum(receive) - receive[me]
        self.last_dispatched_bytes = sent_rows * hidden * rows.element_size()
        # Back to pair order, then sum each token's k rows, as Experts does.
        out = torch.zeros_like(out).index_copy(0, order, out)
        return out.view(-1, top_k, hidden).sum(dim=1)

    def _run_experts(
        self, rows: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """This rank's experts on `rows` [M, hidden], counts[s, l] of them from rank s for l."""
        ranks, local = counts.shape
        expert = torch.arange(local, device=rows.device).repeat(ranks)
        expert = expert.repeat_interleave(counts.flatten(), output_size=rows.shape[0])
        order = expert.sort(stable=True).indices  # by expert, each group in arrival order
        offs = counts.sum(0).cumsum(0).to(torch.int32)  # group ends
        gate_up_proj, down_proj = (
            self._gathered(w, dtype) for w in (self.gate_up_proj, self.down_proj)
        )
        gate, up = grouped_mm(rows[order], gate_up_proj.transpose(1, 2), offs).chunk(2, -1)
        out = grouped_mm(F.silu(gate) * up, down_proj.transpose(1, 2), offs)
        # index_copy, not out[inverse]: its backward hands grouped_mm a dense gradient.
        return torch.zeros_like(out).index_copy(0, order, out)

    def _gathered(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The E / N experts of `weight` this rank runs, [E / N, out, in] in `dtype`."""
        shards = cast(DTensor, weight).to_local()
        gathered = GatherShards.apply(shards, self.gather_group, self.data_parallel_size)
        return cast(torch.Tensor, gathered).to(dtype)


class GatherShards(torch.autograd.Function):
    """All-gather over `group` on dim 0; the backward reduce-scatters and divides by `ranks`.

    Dividing the summed gradient by every data-parallel rank gives the batch mean, as FSDP does
    for the other weights: each rank's gradient already sums its expert-parallel group's tokens.
    """

    @staticmethod
    def forward(ctx: Any, shards: torch.Tensor, group: ProcessGroup, ranks: int) -> torch.Tensor:
        ctx.group, ctx.ranks = group, ranks
        if group.size() == 1:
            return shards.view_as(shards)  # no copy: this rank stores what it runs
        return funcol.wait_tensor(funcol.all_gather_tensor(shards, 0, group))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.group.size() > 1:
            grad = funcol.wait_tensor(funcol.reduce_scatter_tensor(grad, "sum", 0, ctx.group))
        return grad / ctx.ranks, None, None


def exchange(
    rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group: ProcessGroup
) -> torch.Tensor:
    """Send input_splits[r] of `rows` to rank r, receiving output_splits[r] rows from it."""
    return funcol.wait_tensor(
        funcol.all_to_all_single_autograd(rows, output_splits, input_splits, group)
    )


def dispatched_bytes(net: nn.Module) -> int | None:
    """The bytes the last forward of `net`'s expert-parallel layers sent; None without any."""
    layers = [m for m in net.modules() if isinstance(m, ExpertParallelExperts)]
    if not layers:
        return None
    return sum(layer.last_dispatched_bytes for layer in layers)
