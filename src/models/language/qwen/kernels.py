"""The optional fused GPU kernels, the switch that hands them to the layers, and their checks.

The checks say whether this installation's versions can run a given call.

A `Kernels` holds the kernel functions a model's layers call and says which tensors may go to
them; a kernel left None runs as the layer's PyTorch code, which gives the same results. By
default a model uses `installed_kernels()`, imported when a layer first meets a tensor on a GPU
(flash-linear-attention takes seconds to import and warns on a machine without one). The
version checks happen there, once, so that an unsupported version or shape falls back instead of
raising inside a training step.
"""

import functools
import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

HALF_PRECISION = (torch.float16, torch.bfloat16)
# Arguments of varlen_attn that the attention layer passes; PyTorch added them after varlen_attn.
VARLEN_KEYWORDS = ("window_size", "enable_gqa")
CAUSAL_CONV1D_WIDTHS = (2, 3, 4)
# The first flash-linear-attention release whose chunk kernel serves several value heads from one
# key head (value head h reads key head h // (value heads / key heads), as the layers do).
FLA_MINIMUM_VERSION = (0, 6)


def on_gpu_in_half_precision(x: torch.Tensor) -> bool:
    """Whether x may go to the fused kernels, which run on CUDA in fp16/bf16.

    CUDA autocast counts as fp16/bf16, where the norms hand over fp32 activations.
    """
    return x.is_cuda and (x.dtype in HALF_PRECISION or torch.is_autocast_enabled("cuda"))


@dataclass(frozen=True)
class Kernels:
    """The fused kernels a QwenLM's layers call, and the tensors they may call them on.

    varlen_attn: torch.nn.attention.varlen.varlen_attn, for attention over packed documents.
    chunk_gated_delta_rule: flash-linear-attention's, for Gated DeltaNet's recurrence.
    causal_conv1d_fn: causal-conv1d's, for Gated DeltaNet's short convolution.
    eligible: whether a tensor may go to them at all; tests pass `lambda x: True` with
        stand-ins for the kernels to run the layers' kernel branches on CPU.
    """

    varlen_attn: Callable | None = None
    chunk_gated_delta_rule: Callable | None = None
    causal_conv1d_fn: Callable | None = None
    eligible: Callable[[torch.Tensor], bool] = on_gpu_in_half_precision


PYTORCH = Kernels()  # every layer in PyTorch, on every device


def kernels_for(x: torch.Tensor, kernels: Kernels | None) -> Kernels:
    """The kernels for a layer's input x: the model's own, the installed ones, or PyTorch's code.

    `kernels` when the model was given some, else the installed ones where x may use them
    (imported then), else PyTorch's code.
    """
    if kernels is not None:
        return kernels
    return installed_kernels() if on_gpu_in_half_precision(x) else PYTORCH


# Filled on the first call: functools.cache would make torch.compile warn and trace into it.
_installed: list[Kernels] = []


def installed_kernels() -> Kernels:
    """The fused kernels this installation provides, in a form the layers can call.

    They are imported on the first call and kept.
    """
    if not _installed:
        varlen_attn = _import("torch.nn.attention.varlen", "varlen_attn")
        _installed.append(
            Kernels(
                varlen_attn=usable_varlen_attn(varlen_attn),
                chunk_gated_delta_rule=_flash_linear_attention(),
                causal_conv1d_fn=_import("causal_conv1d", "causal_conv1d_fn"),
            )
        )
    return _installed[0]


def _import(module: str, name: str) -> Callable | None:
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:  # not installed, or its CUDA extension does not load here
        return None


def _flash_linear_attention() -> Callable | None:
    rule = _import("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
    if rule is None:
        return None
    return usable_fla_rule(rule, importlib.import_module("fla").__version__)


def usable_fla_rule(rule: Callable, version: str) -> Callable | None:
    """`rule` when flash-linear-attention `version` lets value heads share a key head, else None.

    It must serve several value heads from one key head: older releases need as many key heads as
    value heads.
    """
    release = tuple(int(part) for part in version.split(".")[:2])
    if release < FLA_MINIMUM_VERSION:
        log.warning(
            "flash-linear-attention %s predates %s, the first to serve several value heads per "
            "key head: Gated DeltaNet runs in PyTorch (pip install 'fla-core>=0.6')",
            version,
            ".".join(map(str, FLA_MINIMUM_VERSION)),
        )
        return None
    return rule


@functools.cache
def takes_keywords(fn: Callable, *names: str) -> bool:
    """Whether `fn` accepts every keyword in `names`.

    Kernels gain arguments from one release to the next, and passing one they lack raises a
    TypeError only once training runs.
    """
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (some builtins)
        return False
    return all(name in parameters for name in names)


def usable_varlen_attn(fn: Callable | None) -> Callable | None:
    """`fn` (torch's varlen_attn) when it takes `window_size` and `enable_gqa`, else None.

    With None, packed attention runs as masked scaled_dot_product_attention instead.
    """
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


def causal_conv1d_problem(x: torch.Tensor, kernel_size: int) -> str | None:
    """Why causal-conv1d's kernel cannot convolve x [B, T, channels] at this kernel size, or None.

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
