"""Where a preference loss's reference log-probabilities come from: one class per source.

- `FrozenCopy` (full fine-tuning): a frozen copy of the network as it was built, kept in
  checkpoints so that a resumed run compares against the same reference.
- `AdaptersDisabled` (`adapter=lora`): the frozen base itself, its LoRA adapters switched off
  for the reference's forward: no second copy in memory.
- `Precomputed` (`data.precompute_ref_logps=true`): the values the datamodule computed once
  before training and serves with each batch (`reference_logps` [P, 2]); checkpoints keep
  the fingerprint of the weights they were computed with.

Each gives a `Pair` of [P] sums for a batch, without gradients.
"""

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable

import torch
import xxhash
from torch import nn

from src.models.language.lora.injection import lora_modules
from src.models.language.preference.losses import Pair
from src.models.language.preference.sequences import response_logps
from src.utils.errors import ConfigError


@runtime_checkable
class ReferenceLogpsData(Protocol):
    """A preference datamodule that computes reference log-probabilities once, then serves them.

    `weights_key` identifies the reference weights, for the values stored beside the token
    store; `compute` maps a batch of its pairs to their [P, 2] (chosen, rejected)
    log-probabilities, when they may be computed.
    """

    def serve_reference_logps(
        self,
        weights_key: str,
        compute: Callable[[dict[str, torch.Tensor]], torch.Tensor] | None,
    ) -> None: ...


class Reference(Protocol):
    """A source of reference log-probabilities: (chosen, rejected) [P] sums for a batch."""

    def logps(self, net: nn.Module, batch: dict[str, torch.Tensor]) -> Pair: ...


class FrozenCopy(nn.Module):
    """A frozen copy of `net` as given, held as its own `net`, in eval mode whatever the model's."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = copy.deepcopy(net).requires_grad_(False)

    def train(self, mode: bool = True) -> "FrozenCopy":
        return super().train(False)

    @torch.no_grad()
    def logps(self, net: nn.Module, batch: dict[str, torch.Tensor]) -> Pair:
        return response_logps(self.net, batch)[0]


class AdaptersDisabled:
    """The network's frozen base: its LoRA adapters off for the reference's forward."""

    @torch.no_grad()
    def logps(self, net: nn.Module, batch: dict[str, torch.Tensor]) -> Pair:
        with adapters_disabled(net):
            return response_logps(net, batch)[0]


class CurrentNetwork:
    """The network as it is now, before training: what `Precomputed` computes once."""

    @torch.no_grad()
    def logps(self, net: nn.Module, batch: dict[str, torch.Tensor]) -> Pair:
        return response_logps(net, batch)[0]


class Precomputed(nn.Module):
    """The reference log-probabilities that the datamodule serves with each batch.

    `computes` is how they are computed once, before training: the base under disabled
    adapters, or the network as it starts. The buffer `weights_key` holds the fingerprint of the
    reference weights they were computed with (16 bytes, zeros until known); checkpoints keep
    it, so that evaluating a checkpoint finds the values its run trained with rather than
    computing others.
    """

    weights_key: torch.Tensor

    def __init__(self, computes: Reference):
        super().__init__()
        self.computes = computes
        self.register_buffer("weights_key", torch.zeros(16, dtype=torch.uint8))

    def logps(self, net: nn.Module, batch: dict[str, torch.Tensor]) -> Pair:
        if "reference_logps" not in batch:
            raise ConfigError(
                "model.preference.precomputed_reference=true reads reference log-probabilities "
                "from the batches, and these have none: set data.precompute_ref_logps=true "
                "(data=preferences)"
            )
        chosen, rejected = batch["reference_logps"].unbind(1)
        return Pair(chosen, rejected)

    def prepare(self, net: nn.Module, datamodule: object, device: torch.device) -> None:
        """Have `datamodule` serve the values: found stored, or computed with `net` on `device`.

        Before training `net` is the reference: its fingerprint names the values, which are
        computed unless stored. That is also so when a run resumes, whose checkpoint loads after
        this. Once the key is known (set earlier, or loaded from a checkpoint to evaluate),
        `net` is no reference any more, and the values must be found.
        """
        if not isinstance(datamodule, ReferenceLogpsData):
            raise ConfigError(
                f"model.preference.precomputed_reference=true needs preference data that "
                f"precomputes them (data=preferences data.precompute_ref_logps=true), not "
                f"{type(datamodule).__name__}"
            )
        known = bytes(self.weights_key.tolist())
        if any(known):
            datamodule.serve_reference_logps(known.hex(), compute=None)
            return

        def compute(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            batch = {key: value.to(device) for key, value in batch.items()}
            chosen, rejected = self.computes.logps(net, batch)
            return torch.stack((chosen, rejected), 1).float().cpu()

        net.to(device)
        fingerprint = weights_fingerprint(net)
        self.weights_key.copy_(torch.tensor(list(fingerprint), dtype=torch.uint8))
        datamodule.serve_reference_logps(fingerprint.hex(), compute)


def weights_fingerprint(net: nn.Module) -> bytes:
    """A 16-byte hash of the names and bytes of every tensor of `net`'s state dict."""
    digest = xxhash.xxh3_128()
    for name, tensor in net.state_dict().items():
        digest.update(name.encode() + b"\0")
        digest.update(tensor.detach().reshape(-1).cpu().view(torch.uint8).numpy().tobytes())
    return digest.digest()


@contextmanager
def adapters_disabled(net: nn.Module) -> Iterator[None]:
    """`net` computing as its base while inside: every LoRA layer's adapters switched off.

    peft's switch also clears the adapters' `requires_grad`; switching them on sets it again.
    """
    layers: list[Any] = list(lora_modules(net).values())  # type: ignore[arg-type]  # any network
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
