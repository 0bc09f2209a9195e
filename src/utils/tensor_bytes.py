"""The bytes a model's tensors take as stored, a quantised weight at its packed size.

metrics.json records it for every run (`model/parameter_bytes`), so that a 4-bit base (QLoRA)
and a full-precision one compare on one number.
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def stored_bytes(tensor: torch.Tensor) -> int:
    """The bytes of `tensor` as stored.

    A tensor subclass that holds others (torchao's `NF4Tensor`: packed 4-bit codes and its
    scales) counts those; a DTensor shard stands for the whole tensor, scaled from its local
    part; a bitsandbytes 4-bit weight adds its quantisation state (`quant_state`) to its
    packed bytes.
    """
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        if local.numel() == 0:
            return tensor.numel() * tensor.element_size()
        return round(stored_bytes(local) * tensor.numel() / local.numel())
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is not None:
        names, _ = flatten(tensor)
        return sum(stored_bytes(getattr(tensor, name)) for name in names)
    size = tensor.numel() * tensor.element_size()
    if (state := getattr(tensor, "quant_state", None)) is not None:
        size += _state_bytes(state)
    return size


def _state_bytes(state: object) -> int:
    """The tensors of a bitsandbytes QuantState (absmax, code, ... and the nested `state2`)."""
    total = 0
    for value in vars(state).values():
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif hasattr(value, "absmax"):  # the nested state of double quantisation
            total += _state_bytes(value)
    return total


def module_bytes(module: nn.Module) -> int:
    """The bytes of every parameter and buffer of `module` as stored, each shared tensor once."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(stored_bytes(t) for t in tensors.values())
