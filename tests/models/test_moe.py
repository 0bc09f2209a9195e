"""The mixture-of-experts block against transformers' Qwen3-MoE, Qwen3-Next and Qwen3.5-MoE blocks.

Each reference block gets random weights, ours loads its state dict strictly (so the parameter
names are transformers'), and both run on the same input, in fp32 on the CPU.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from src.models.language.qwen.grouped_mm import traceable_grouped_mm
from src.models.language.qwen.moe import (
    Experts,
    Router,
    SparseMoeBlock,
    count_tokens,
    expert_load,
    load_balancing_loss,
)

hf_qwen3_moe = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
hf_qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

HIDDEN, INTERMEDIATE, SHARED, EXPERTS, TOP_K = 32, 16, 24, 8, 2

# (family, norm_topk_prob); Qwen3.5-MoE always normalises the top-k weights.
CASES = [
    ("qwen3_moe", True),
    ("qwen3_moe", False),
    ("qwen3_next", True),
    ("qwen3_next", False),
    ("qwen3_5_moe", True),
]
# transformers' per-expert loop and its grouped_mm path; both are deterministic on the CPU.
IMPLEMENTATIONS = ["eager", "grouped_mm"]


def reference_block(family: str, norm: bool, implementation: str = "eager") -> torch.nn.Module:
    """A transformers MoE block of `family` with random weights, running `implementation`."""
    sizes = dict(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTERMEDIATE,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
    )
    if family == "qwen3_moe":
        config = hf_qwen3_moe.Qwen3MoeConfig(**sizes, norm_topk_prob=norm)
        block_class = hf_qwen3_moe.Qwen3MoeSparseMoeBlock
    elif family == "qwen3_next":
        config = hf_qwen3_next.Qwen3NextConfig(
            **sizes, norm_topk_prob=norm, shared_expert_intermediate_size=SHARED
        )
        block_class = hf_qwen3_next.Qwen3NextSparseMoeBlock
    else:
        hf_qwen3_5_moe = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
        config = hf_qwen3_5_moe.Qwen3_5MoeTextConfig(
            **sizes, shared_expert_intermediate_size=SHARED
        )
        block_class = hf_qwen3_5_moe.Qwen3_5MoeSparseMoeBlock
    config._experts_implementation = implementation
    block = block_class(config)
    with torch.no_grad():
        for parameter in block.parameters():  # the experts start uninitialised (torch.empty)
            parameter.normal_(std=0.2)
    return block


def copy_of(reference: torch.nn.Module, norm: bool) -> SparseMoeBlock:
    """Our block with `reference`'s weights, loaded strictly by transformers' names."""
    shared = SHARED if hasattr(reference, "shared_expert") else 0
    ours = SparseMoeBlock(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, norm, shared)
    ours.load_state_dict(reference.state_dict())
    return ours


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference between a and b, relative to b's largest magnitude."""
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(("family", "norm"), CASES)
def test_output_and_gradients_match_transformers(family, norm, implementation):
    torch.manual_seed(0)
    reference = reference_block(family, norm, implementation)
    ours = copy_of(reference, norm)
    x = torch.randn(2, 7, HIDDEN)
    upstream = torch.randn(2, 7, HIDDEN)
    x_ours, x_reference = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected_out = ours(x_ours), reference(x_reference)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-5)
    out.backward(upstream)
    expected_out.backward(upstream)
    assert relative_difference(x_ours.grad, x_reference.grad) < 1e-4
    expected = dict(reference.named_parameters())
    for name, parameter in ours.named_parameters():
        assert relative_difference(parameter.grad, expected[name].grad) < 1e-4, name


@pytest.mark.parametrize("shared", [0, SHARED])
@pytest.mark.parametrize("tokens", [1, 7, 16])
def test_backward_of_a_sum(shared, tokens):
    # out.sum() hands back a zero-stride gradient, which grouped_mm's backward rejects as such.
    torch.manual_seed(2)
    block = SparseMoeBlock(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, True, shared)
    x = torch.randn(1, tokens, HIDDEN, requires_grad=True)
    block(x).sum().backward()
    assert x.grad is not None
    assert x.grad.isfinite().all()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in block.parameters())


def test_router_matches_transformers():
    torch.manual_seed(3)
    reference = reference_block("qwen3_moe", True).gate
    router = Router(HIDDEN, EXPERTS, TOP_K, normalise=True)
    router.load_state_dict(reference.state_dict())
    x = torch.randn(9, HIDDEN)
    logits, weights, indices = router(x)
    expected = reference(x)
    assert logits.dtype == weights.dtype == torch.float32
    assert indices.dtype == torch.long
    assert logits.shape == (9, EXPERTS)
    assert weights.shape == indices.shape == (9, TOP_K)
    torch.testing.assert_close(logits, expected[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(weights, expected[1], rtol=0, atol=1e-6)
    assert torch.equal(indices, expected[2])


@pytest.mark.parametrize(("layers", "top_k"), [(2, 2), (3, 3)])
def test_load_balancing_loss_matches_transformers(layers, top_k):
    torch.manual_seed(4)
    logits = [torch.randn(11, EXPERTS, requires_grad=True) for _ in range(layers)]
    loss = load_balancing_loss(logits, EXPERTS, top_k)
    expected = hf_qwen3_moe.load_balancing_loss_func(tuple(logits), EXPERTS, top_k)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
    gradients = torch.autograd.grad(loss, logits)
    for gradient, reference in zip(gradients, torch.autograd.grad(expected, logits), strict=True):
        torch.testing.assert_close(gradient, reference, rtol=0, atol=1e-6)


def test_block_records_its_routing():
    torch.manual_seed(5)
    block = SparseMoeBlock(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, True)
    x = torch.randn(3, 4, HIDDEN)
    block(x)
    logits = block.router_logits
    assert logits.shape == (12, EXPERTS)
    assert logits.requires_grad
    assert block.last_routing is not None
    assert block.last_routing.router_logits is logits
    chosen = logits.softmax(-1).topk(TOP_K, dim=-1).indices
    assert torch.equal(block.tokens_per_expert, torch.bincount(chosen.flatten(), minlength=8))
    assert not block.tokens_per_expert.requires_grad
    assert block.tokens_per_expert.sum() == 12 * TOP_K


def test_count_tokens_and_expert_load():
    indices = torch.tensor([[0, 3], [3, 1], [3, 0]])
    counts = count_tokens(indices, 5)
    assert counts.tolist() == [2, 1, 0, 3, 0]
    assert expert_load(counts).item() == pytest.approx(3 / 1.2)
    assert expert_load(torch.tensor([4, 4, 4])).item() == 1.0


def test_an_expert_without_tokens():
    torch.manual_seed(6)
    dead = 5
    reference = reference_block("qwen3_next", True)
    with torch.no_grad():
        # Every input below has a positive sum, so this row's logit is far below the others.
        reference.gate.weight[dead] = -100.0
    ours = copy_of(reference, True)
    x = torch.rand(2, 9, HIDDEN) + 0.5
    upstream = torch.randn(2, 9, HIDDEN)
    x_ours, x_reference = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = ours(x_ours)
    assert ours.tokens_per_expert[dead] == 0
    assert (ours.tokens_per_expert > 0).sum() > TOP_K
    torch.testing.assert_close(out, reference(x_reference), rtol=0, atol=1e-5)
    out.backward(upstream)
    assert (ours.experts.gate_up_proj.grad[dead] == 0).all()
    assert (ours.experts.down_proj.grad[dead] == 0).all()
    reference(x_reference).backward(upstream)
    for name in ("gate_up_proj", "down_proj"):
        gradient = getattr(ours.experts, name).grad
        assert relative_difference(gradient, getattr(reference.experts, name).grad) < 1e-4


def test_routing_is_per_token():
    torch.manual_seed(7)
    block = SparseMoeBlock(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, True, SHARED)
    x = torch.randn(3, 6, HIDDEN)
    with torch.no_grad():
        out = block(x)
        for row in range(3):
            torch.testing.assert_close(block(x[row : row + 1]), out[row : row + 1])
        # Reordering the tokens, as packing other rows together would, reorders the output.
        order = torch.randperm(18)
        flat = x.reshape(1, 18, HIDDEN)
        torch.testing.assert_close(block(flat[:, order]), out.reshape(1, 18, HIDDEN)[:, order])


# Ops that wait for the device: a scalar read, or an output whose size depends on the values.
HOST_SYNC_OPS = {
    "_local_scalar_dense",
    "item",
    "nonzero",
    "masked_select",
    "bincount",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "is_nonzero",
}


class OpRecorder(TorchDispatchMode):
    """Records the name of every aten op that runs, and which of them index with a bool mask."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.boolean_indexing: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops.append(name)
        if name.startswith(("index", "_index_put")) and len(args) > 1:
            indices = args[1] if isinstance(args[1], list | tuple) else [args[1]]
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                self.boolean_indexing.append(name)
        return func(*args, **(kwargs or {}))

    def syncs(self) -> list[str]:
        """The recorded ops that synchronise with the host."""
        return [op for op in self.ops if op in HOST_SYNC_OPS] + self.boolean_indexing


def test_the_recorder_sees_host_syncs():
    x = torch.randn(8)
    with OpRecorder() as recorder:
        x.sum().item()
        x[x > 0].nonzero()
    assert {"_local_scalar_dense", "nonzero", "index"} <= set(recorder.syncs())


def test_no_host_sync_in_forward_backward_and_loss():
    torch.manual_seed(8)
    block = SparseMoeBlock(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, True, SHARED)
    x = torch.randn(2, 5, HIDDEN, requires_grad=True)
    with OpRecorder() as recorder:
        out = block(x)
        loss = out.square().mean() + load_balancing_loss([block.router_logits], EXPERTS, TOP_K)
        expert_load(block.tokens_per_expert)
        loss.backward()
    assert recorder.syncs() == []
    assert "_grouped_mm" in recorder.ops or "grouped_mm" in recorder.ops
    assert "silu_backward" in recorder.ops  # the backward ran under the recorder too


def test_half_precision_and_unsupported_dtypes():
    torch.manual_seed(9)
    block = SparseMoeBlock(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, True, SHARED)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(std=0.2)
    x = torch.randn(2, 8, HIDDEN)
    with torch.no_grad():
        expected = block(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = block(x)
            _, weights, indices = block.gate(x.view(-1, HIDDEN))
            routed = block.experts(x.view(-1, HIDDEN), indices, weights)
        half = block.to(torch.bfloat16)(x.bfloat16())
    assert routed.dtype == torch.float32  # on a CPU the experts run in fp32 under autocast
    assert half.dtype == torch.bfloat16  # and in the parameters' dtype without it
    assert relative_difference(autocast.float(), expected) < 0.05
    assert relative_difference(half.float(), expected) < 0.05
    with pytest.raises(TypeError, match="float32, bfloat16 and float16"):
        block.double()(x.double())


def test_sizes_grouped_mm_cannot_take():
    with pytest.raises(ValueError, match="multiples of 8"):
        Experts(hidden_size=30, intermediate_size=16, num_experts=4)


def test_a_block_that_has_run_with_gradients_deep_copies_without_its_routing():
    """EMA and other callbacks copy the model mid-training; the router's graph cannot be copied."""

    block = SparseMoeBlock(16, 8, 4, 2, True)
    block(torch.randn(1, 3, 16, requires_grad=True))
    twin = copy.deepcopy(block)
    assert twin.last_routing is None
    assert block.last_routing is not None
    assert torch.equal(twin.experts.gate_up_proj, block.experts.gate_up_proj)


def test_the_traceable_grouped_mm_computes_what_torch_computes():
    # Three groups, the middle one empty: rows 0-4 to expert 0, 5-8 to expert 2.
    offs = torch.tensor([5, 5, 9], dtype=torch.int32)
    rows = torch.randn(9, 16, requires_grad=True)
    weight = torch.randn(3, 16, 24, requires_grad=True)
    grad = torch.randn(9, 24)
    results = []
    for op in (traceable_grouped_mm, lambda a, b, o: F.grouped_mm(a, b, offs=o)):
        out = op(rows, weight, offs)
        rows_grad, weight_grad = torch.autograd.grad(out, (rows, weight), grad)
        results.append((out, rows_grad, weight_grad))
    for ours, torchs in zip(*results, strict=True):
        torch.testing.assert_close(ours, torchs, rtol=0, atol=0)
    assert results[0][2][1].abs().sum() == 0  # the empty group's weight gets no gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_block_compiles_in_the_dtypes_torchs_fake_kernel_refuses(dtype):
    # aot_eager traces with fake tensors and AOT autograd, where torch's own fake kernel of
    # grouped_mm refuses float32 (and float16 without cuBLASLt), then runs the graphs eagerly.
    torch.manual_seed(0)
    block = SparseMoeBlock(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, True, SHARED).to(dtype)
    compiled = torch.compile(copy.deepcopy(block), backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 6, HIDDEN, dtype=dtype)
    outputs, grads = [], []
    for model in (block, compiled):
        out = model(x)
        out.float().square().sum().backward()
        outputs.append(out)
        grads.append([p.grad for p in model.parameters()])
    torch.testing.assert_close(outputs[1], outputs[0])
    for compiled_grad, eager_grad in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(compiled_grad, eager_grad)
