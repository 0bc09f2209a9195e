"""The optional fused GPU kernels, and whether this installation's versions can run a given call.

Each kernel is None where its package, or this PyTorch release, does not provide it in the form
the layers call; the layers then run their PyTorch code, which gives the same results. The
checks happen here, once, so that an unsupported version or shape falls back instead of raising
inside a training step.
"""

import functools
import inspect
import logging
from collections.abc import Callable

import torch

try:  # FlashAttention's varlen kernel as shipped in PyTorch (CUDA, fp16/bf16)
    from torch.nn.attention.varlen import varlen_attn as _torch_varlen_attn
except ImportError:  # older PyTorch
    _torch_varlen_attn = None
try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule
except ImportError:
    fla_chunk_gated_delta_rule = None
try:
    from causal_conv1d import causal_conv1d_fn
except ImportError:
    causal_conv1d_fn = None

log = logging.getLogger(__name__)

# Arguments of varlen_attn that the attention layer passes; PyTorch added them after varlen_attn.
VARLEN_KEYWORDS = ("window_size", "enable_gqa")
CAUSAL_CONV1D_WIDTHS = (2, 3, 4)


@functools.cache
def takes_keywords(fn: Callable, *names: str) -> bool:
    """Whether `fn` accepts every keyword in `names`: kernels gain arguments from one release to
    the next, and passing one they lack raises a TypeError only once training runs."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (some builtins)
        return False
    return all(name in parameters for name in names)


def usable_varlen_attn(fn: Callable | None) -> Callable | None:
    """`fn` (torch's varlen_attn) when it takes `window_size` and `enable_gqa`, else None, so
    that packed attention runs as masked scaled_dot_product_attention instead."""
    if fn is None:
        return None
    if not takes_keywords(fn, *VARLEN_KEYWORDS):
        log.info(
            "varlen_attn of PyTorch %s takes no %s (added in later releases): packed attention "
            "runs as scaled_dot_product_attention with a block-diagonal mask",
            torch.__version__,
            " / ".join(VARLEN_KEYWORDS),
        )
        return None
    return fn


varlen_attn = usable_varlen_attn(_torch_varlen_attn)


def causal_conv1d_problem(x: torch.Tensor, kernel_size: int) -> str | None:
    """Why causal-conv1d's kernel cannot convolve x [B, T, channels] with this kernel size, or
    None when it can.

    The kernel reads x channel-last (x.transpose(1, 2) of a [B, T, channels] tensor), which it
    supports only in vectors of 8 channels, and is compiled for widths 2 to 4.
    """
    channels = x.shape[-1]
    if kernel_size not in CAUSAL_CONV1D_WIDTHS:
        return f"kernel width {kernel_size}; it supports widths {CAUSAL_CONV1D_WIDTHS}"
    if channels % 8:
        return f"{channels} channels; it needs a channel count divisible by 8"
    if x.stride(-1) != 1 or x.stride(0) % 8 or x.stride(1) % 8:
        return f"strides {x.stride()}; it needs unit channel stride and the others multiples of 8"
    return None


def causal_conv1d_fits(x: torch.Tensor, kernel_size: int) -> bool:
    """Whether causal-conv1d can convolve x; the reason it cannot is logged once per reason."""
    problem = causal_conv1d_problem(x, kernel_size)
    if problem is not None and not torch.compiler.is_compiling():  # a log would split the graph
        _log_once(f"causal-conv1d cannot run {problem}: the convolution runs in PyTorch")
    return problem is None


@functools.cache
def _log_once(message: str) -> None:
    log.warning(message)
