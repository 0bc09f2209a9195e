"""`grouped_mm` that torch.compile can trace in float32 and float16 too.

torch 2.14's fake kernel of `torch._grouped_mm`, which torch.compile traces with, checks CUDA's
fast kernels: it refuses float32, and float16 without cuBLASLt's grouped GEMM. Eager runs both:
on a CPU, where float32 is the dtype the experts run in (see `moe.compute_dtype`), and through
CUDA's fallback. So a float32 mixture of experts under `+compile=...` stopped at tracing. Here
those dtypes go through a custom op with a fake kernel of its own and a backward made of the same
op, so the compiled graph calls `F.grouped_mm` exactly as eager does; no library offers this.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

# The dtype torch's own fake kernel traces on every machine.
TRACEABLE_DTYPES = (torch.bfloat16,)


@torch.library.custom_op("template::grouped_mm", mutates_args=())
def traceable_grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """F.grouped_mm(a, b, offs=offs), as an op torch.compile does not look into.

    a [N, K] @ b [G, K, M] -> [N, M], or, for the weights' gradient, a [K, N] @ b [N, M] ->
    [G, K, M].
    """
    return F.grouped_mm(a, b, offs=offs)


@traceable_grouped_mm.register_fake
def _shape(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[-1])


def _save_inputs(ctx, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
    """The rows' gradient is grad @ b_g^T per group, the weights' a_g^T @ grad_g per group."""
    a, b, offs = ctx.saved_tensors
    if b.dim() != 3:
        raise RuntimeError("grouped_mm's weight gradient cannot be differentiated again")
    grad = grad.contiguous()
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_a = traceable_grouped_mm(grad, b.transpose(-2, -1), offs)
    if ctx.needs_input_grad[1]:
        grad_b = traceable_grouped_mm(a.transpose(0, 1), grad, offs)
    return grad_a, grad_b, None


traceable_grouped_mm.register_autograd(_backward, setup_context=_save_inputs)


def grouped_mm(rows: Tensor, weight: Tensor, offs: Tensor) -> Tensor:
    """Multiply rows [N, K] by weight [G, K, M], group g taking rows offs[g - 1]:offs[g].

    torch's own op everywhere but in a float32 or float16 graph being compiled.
    """
    if torch.compiler.is_compiling() and rows.dtype not in TRACEABLE_DTYPES:
        return traceable_grouped_mm(rows, weight, offs)
    return F.grouped_mm(rows, weight, offs=offs)
