"""The 4-bit base of QLoRA: the `adapter.quantization` values and the backends that apply them.

A QwenLM's linear projections (attention, Gated DeltaNet, MLP and shared-expert projections)
are stored as NF4 with double quantisation, as in the QLoRA paper (Dettmers et al., 2023): each
block of `block_size` weights is scaled by its absolute maximum, and those scales are quantised
again to 8 bits in blocks of `scaler_block_size`. Everything else (embeddings, lm_head, norms,
the DeltaNet gates and convolution, the router, a mixture of experts' stacked experts) stays
unquantised, in `compute_dtype`, the dtype the 4-bit weights are dequantised to when they are
used.

Two backends: torchao's `NF4Tensor` (CPU and GPU; the weight stays an `nn.Linear` parameter, and
`F.linear` dequantises it block by block) and bitsandbytes' `Linear4bit` (its CUDA kernels; the
module is replaced). Each is one class with the same three methods.
"""

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol

import torch
from torch import nn

from src.models.language.lora.injection import is_adapter_key
from src.models.language.lora.spec import quiet_torchao_import
from src.models.language.qwen import QwenLM
from src.utils.errors import ConfigError

log = logging.getLogger(__name__)

QUANT_TYPES = ("nf4",)
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
BITSANDBYTES_SCALER_BLOCK = 256  # bitsandbytes quantises the scales in blocks of 256, fixed
INSTALL = 'pip install -e ".[qlora]"'


@dataclass(frozen=True)
class Quantization:
    """How QLoRA stores its base (`adapter.quantization`): 4-bit type, blocks, dtype, backend."""

    quant_type: str = "nf4"
    block_size: int = 64  # weights per absmax scale
    scaler_block_size: int = 256  # scales per second-level (double quantisation) scale
    compute_dtype: str = "bfloat16"  # the unquantised base, and the 4-bit weights dequantised
    backend: str = "torchao"  # or bitsandbytes (CUDA)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "Quantization":
        known = [f.name for f in fields(cls)]
        if unknown := sorted(set(values) - set(known)):
            raise ConfigError(f"adapter.quantization: unknown keys {unknown}; it takes {known}")
        spec = cls(**values)
        choices = {
            "quant_type": QUANT_TYPES,
            "compute_dtype": COMPUTE_DTYPES,
            "backend": tuple(BACKENDS),
        }
        for key, allowed in choices.items():
            if getattr(spec, key) not in allowed:
                raise ConfigError(
                    f"adapter.quantization.{key}={getattr(spec, key)!r}: choose one of "
                    f"{', '.join(allowed)}"
                )
        for key in ("block_size", "scaler_block_size"):
            value = getattr(spec, key)
            if not isinstance(value, int) or value < 2 or value % 2:
                raise ConfigError(
                    f"adapter.quantization.{key}={value!r}: give an even number of weights "
                    f"(QLoRA's are 64 and 256)"
                )
        return spec

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.compute_dtype)

    def backend_for(self) -> "Backend":
        return BACKENDS[self.backend](self)


class Backend(Protocol):
    """What QLoRA asks of a 4-bit backend."""

    def quantize(self, net: QwenLM) -> None: ...  # store the base's linear weights in 4 bits

    def dense_state(self, net: QwenLM) -> dict[str, torch.Tensor]: ...  # 4-bit ones dequantised


def base_linears(net: QwenLM) -> Iterator[tuple[str, nn.Linear]]:
    """The decoder's linear layers, by name: the projections, not lm_head nor the adapters.

    Under peft's LoRA layers they are the `base_layer`s (`...q_proj.base_layer`).
    """
    for name, module in net.model.named_modules(prefix="model"):
        if isinstance(module, nn.Linear) and not is_adapter_key(f"{name}."):
            yield name, module


def cast_base(net: QwenLM, dtype: torch.dtype) -> None:
    """Put the unquantised base in `dtype`; the adapters stay in fp32.

    The adapters are the weights AdamW updates: in bf16 an update below 2^-9 of a weight is
    lost (peft, too, keeps them in fp32 by default).
    """
    for name, parameter in net.named_parameters():
        wanted = torch.float32 if is_adapter_key(name) else dtype
        if parameter.is_floating_point() and parameter.dtype != wanted:
            parameter.data = parameter.data.to(wanted)


def log_left_dense(left: list[str], spec: Quantization, why: str) -> None:
    if left:
        log.info(
            "QLoRA keeps %d linear weights in %s (%s): %s%s",
            len(left),
            spec.compute_dtype,
            why,
            ", ".join(left[:4]),
            " ..." if len(left) > 4 else "",
        )


class TorchaoNF4:
    """NF4 weights as torchao's `NF4Tensor`, on CPU and GPU (backend=torchao).

    A weight becomes an `NF4Tensor` parameter of its `nn.Linear`: packed 4-bit codes, an int8
    scale per block and an fp scale per block of scales. `F.linear` dequantises it to
    `compute_dtype` in forward and backward; it never requires a gradient. torchao stores a
    tensor whose size is a multiple of `block_size * scaler_block_size` (16,384 weights at
    QLoRA's blocks, which every Qwen projection is); smaller ones (Qwen3.5-MoE's
    `shared_expert_gate`, a tiny test model's) stay in `compute_dtype`, as do the stacked
    experts (3-D).
    """

    def __init__(self, spec: Quantization):
        self.spec = spec
        self.ao = import_torchao()

    def quantize(self, net: QwenLM) -> None:
        spec, ao = self.spec, self.ao
        cast_base(net, spec.dtype)
        left = []
        for name, linear in base_linears(net):
            weight = linear.weight
            if isinstance(weight, ao.NF4Tensor):
                continue
            if weight.numel() % (spec.block_size * spec.scaler_block_size):
                left.append(name)
                continue
            packed = ao.to_nf4(
                weight.detach().contiguous(), spec.block_size, spec.scaler_block_size
            )
            linear.weight = nn.Parameter(packed, requires_grad=False)
        log_left_dense(left, spec, "sizes not a multiple of block_size * scaler_block_size")

    def dense_state(self, net: QwenLM) -> dict[str, torch.Tensor]:
        return {
            key: value.get_original_weight() if isinstance(value, self.ao.NF4Tensor) else value
            for key, value in net.state_dict().items()
        }


class BitsandbytesNF4:
    """NF4 weights as bitsandbytes' `Linear4bit` (backend=bitsandbytes, on CUDA).

    Each quantisable `nn.Linear` (see TorchaoNF4) is replaced by a `Linear4bit` holding the same
    weight as `Params4bit` with `compress_statistics` (double quantisation, scales in blocks of
    256); bitsandbytes quantises it when it moves to the GPU.
    """

    def __init__(self, spec: Quantization):
        if spec.scaler_block_size != BITSANDBYTES_SCALER_BLOCK:
            raise ConfigError(
                f"adapter.quantization.scaler_block_size={spec.scaler_block_size}: "
                f"bitsandbytes quantises the scales in blocks of {BITSANDBYTES_SCALER_BLOCK}; "
                f"set it to {BITSANDBYTES_SCALER_BLOCK} or use backend=torchao"
            )
        self.spec = spec
        self.bnb = import_bitsandbytes()

    def quantize(self, net: QwenLM) -> None:
        spec, bnb = self.spec, self.bnb
        cast_base(net, spec.dtype)
        modules = dict(net.named_modules())
        left = []
        for name, linear in list(base_linears(net)):
            if linear.weight.numel() % spec.block_size:
                left.append(name)
                continue
            quantized = bnb.nn.Linear4bit(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                compute_dtype=spec.dtype,
                compress_statistics=True,
                quant_type=spec.quant_type,
                device="meta",
            )
            quantized.weight = bnb.nn.Params4bit(
                linear.weight.data,
                requires_grad=False,
                compress_statistics=True,
                quant_type=spec.quant_type,
                blocksize=spec.block_size,
            )
            if linear.bias is not None:
                quantized.bias = linear.bias
            parent, _, leaf = name.rpartition(".")
            # bitsandbytes quantises a weight when it moves to its device.
            setattr(modules[parent], leaf, quantized.to(linear.weight.device))
        log_left_dense(left, spec, "sizes not a multiple of block_size")

    def dense_state(self, net: QwenLM) -> dict[str, torch.Tensor]:
        """The state dict with each `Linear4bit` weight dequantised.

        Its quantisation state (`weight.absmax`, `weight.quant_map`, ...) is left out.
        """
        bnb = self.bnb
        packed = {
            f"{name}.weight": module.weight
            for name, module in net.named_modules()
            if isinstance(module, bnb.nn.Linear4bit)
        }
        state = {}
        for key, value in net.state_dict().items():
            if key.split(".weight.")[0] + ".weight" in packed and key not in packed:
                continue
            if (weight := packed.get(key)) is not None and weight.quant_state is not None:
                value = bnb.functional.dequantize_4bit(weight.data, weight.quant_state)
            state[key] = value.to(self.spec.dtype) if key in packed else value
        return state


BACKENDS: dict[str, Callable[[Quantization], Backend]] = {
    "torchao": TorchaoNF4,
    "bitsandbytes": BitsandbytesNF4,
}


def import_torchao():
    """The package of torchao's `NF4Tensor` and `to_nf4`, imported when QLoRA is used."""
    try:
        with quiet_torchao_import():
            import torchao.quantization
    except ImportError as error:
        raise ConfigError(
            f"adapter=qlora stores the base in 4 bits with torchao, which is not installed "
            f"({error}): {INSTALL}"
        ) from None
    return torchao.quantization


def import_bitsandbytes():
    """bitsandbytes, imported when asked for (with a clear error when it is not there)."""
    try:
        import bitsandbytes
    except ImportError as error:
        raise ConfigError(
            f"adapter.quantization.backend=bitsandbytes needs bitsandbytes, which is not "
            f"installed ({error}): pip install bitsandbytes (its CUDA kernels), or use "
            f"backend=torchao (CPU and GPU)"
        ) from None
    return bitsandbytes
