"""Stop a run whose numbers run away, naming the cause: bad data, or the learning rate.

A training batch holding NaN or Inf stops the run as bad data before the model sees it; a
finite loss grown `max_growth` times past the run's first one stops it as divergence, before the
step is taken (a NaN or Inf loss is FiniteCheck's). `max_growth=null` leaves out that check, for
losses that are not a size to compare, such as GRPO's, whose advantages average to zero. Lightning's
`EarlyStopping(check_finite=True, divergence_threshold=...)` looks at a logged metric only when
an epoch or validation ends, and ends the run as a success; torch's anomaly detection names the
operation that made a NaN at the cost of a far slower backward, and takes NaN inputs for a
fault of the model.

The checks cost one device synchronisation per step each (none for a batch of integer token
ids) and no collective: on several ranks, the rank that sees the fault raises, as FiniteCheck
does, and Lightning's launcher ends the others. Turn them off with `callbacks.divergence=null`.
"""

import math
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from src.utils.errors import DataError, UserFacingError


class DivergenceError(UserFacingError, FloatingPointError):
    """The training loss exploded; the message names the step, the loss and the learning rate."""


class Divergence(Callback):
    """Raises DataError on a batch that is not finite, DivergenceError on a loss that explodes.

    The first loss is kept in checkpoints, so a resumed run compares with the same one.
    """

    def __init__(self, max_growth: float | None = 1000.0):
        self.max_growth = max_growth
        self.first_loss: float | None = None

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        floats = [(name, t) for name, t in named_tensors(batch) if t.is_floating_point()]
        if not floats:  # token ids: nothing can be NaN
            return
        finite = torch.stack([torch.isfinite(t).all() for _, t in floats]).tolist()  # one sync
        bad = next((floats[i] for i, ok in enumerate(finite) if not ok), None)
        if bad is None:
            return
        name, tensor = bad
        count = (~torch.isfinite(tensor)).sum().item()
        raise DataError(
            f"The training batch of step {trainer.global_step} (epoch {trainer.current_epoch}, "
            f"batch {batch_idx}) is not finite: {count} of the {tensor.numel()} values of "
            f"{name} are NaN or Inf. That is the data, not the learning rate: fix or leave out "
            f"the samples that hold them (or the transform that makes them)."
        )

    def on_before_backward(
        self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor
    ) -> None:
        if self.max_growth is None:
            return
        # Lightning hands the loss divided by the batches a step accumulates: undo it.
        scale = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
        size = loss.detach().abs() * scale
        if self.first_loss is None:
            first = size.item()
            if math.isfinite(first) and first > 0:
                self.first_loss = first
            return
        if not size > self.max_growth * self.first_loss:
            return
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        raise DivergenceError(
            f"Training diverged at step {trainer.global_step} (epoch {trainer.current_epoch}): "
            f"the loss is {size.item():.3g}, over {self.max_growth:g} times the first step's "
            f"{self.first_loss:.4g}; this step was not taken. The learning rate ({lr:g}) is the "
            f"likely cause: lower optimizer.lr, or warm it up (scheduler=warmup_cosine) or clip "
            f"gradients (trainer.gradient_clip_val=1.0)."
        )

    def state_dict(self) -> dict[str, Any]:
        return {"first_loss": self.first_loss}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.first_loss = state_dict.get("first_loss")


def named_tensors(batch: Any, name: str = "batch") -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a batch (tensors in dicts, lists and tuples), each with where it is."""
    if isinstance(batch, torch.Tensor):
        yield name, batch
    elif isinstance(batch, dict):
        for key, value in batch.items():
            yield from named_tensors(value, f"{name}[{key!r}]")
    elif isinstance(batch, list | tuple):
        for index, value in enumerate(batch):
            yield from named_tensors(value, f"{name}[{index}]")
