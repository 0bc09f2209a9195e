"""Stop at the first NaN or Inf loss or gradient, before it reaches the weights.

The check costs one device synchronisation per step (negligible on CPU); turn it off with
`callbacks.finite_check=null` once a model is known to train stably.
"""

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.optim import Optimizer

from src.utils.errors import UserFacingError


class NonFiniteError(UserFacingError, FloatingPointError):
    """Training produced NaN or Inf; the message names the step and the first culprit."""


class FiniteCheck(Callback):
    """Raises NonFiniteError on a non-finite loss or gradient, so no checkpoint holds bad weights.

    The loss is checked before backward, the gradients before the optimizer step.
    """

    def on_before_backward(
        self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor
    ) -> None:
        if not torch.isfinite(loss):
            self._stop(trainer, f"the loss is {loss.item()}")

    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer
    ) -> None:
        grads = [(name, p.grad) for name, p in pl_module.named_parameters() if p.grad is not None]
        # One fused norm over all gradients is Inf or NaN exactly when one of them is (short of
        # an overflow no training survives); only then look for the culprit, tensor by tensor.
        if not grads or torch.isfinite(torch.nn.utils.get_total_norm([g for _, g in grads])):
            return
        culprit = next(name for name, g in grads if not g.isfinite().all())
        weights = [name for name, p in pl_module.named_parameters() if not p.isfinite().all()]
        detail = f"; non-finite weights: {weights[0]}" if weights else ""
        self._stop(trainer, f"the gradient of {culprit} is not finite{detail}")

    @staticmethod
    def _stop(trainer: Trainer, what: str) -> None:
        callbacks = trainer.checkpoint_callbacks  # ModelCheckpoints, typed as their base class
        saved = [cb.last_model_path or cb.best_model_path for cb in callbacks]  # type: ignore[attr-defined]
        last_good = next((path for path in saved if path), None)
        raise NonFiniteError(
            f"Training stopped at step {trainer.global_step} (epoch {trainer.current_epoch}): "
            f"{what}. The weights were not updated with it. Last good checkpoint: "
            f"{last_good or 'none written yet'}. Common fixes: a lower learning rate, gradient "
            f"clipping (trainer.gradient_clip_val=1.0), or bf16 instead of fp16."
        )
