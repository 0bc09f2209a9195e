"""Lightning's values and decisions as plain Python, read in one place."""

import math
from typing import Any

import torch


def as_number(value: Any) -> Any:
    """Tensors and NumPy scalars to plain Python numbers (NaN/inf to None, for valid JSON)."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def is_logging_step(trainer: Any) -> bool:
    """Whether the current training step is one that `trainer.log_every_n_steps` logs.

    Lightning decides this in a private connector; reading it here, in one place, keeps the
    rest of the code on one definition (and one spot to fix if Lightning renames it)."""
    return bool(trainer._logger_connector.should_update_logs)


def metrics_logged_this_step(trainer: Any) -> dict[str, Any]:
    """What Lightning sends the loggers at the end of this training batch.

    That is the values logged on step, on logging steps that step the optimizer; nothing on
    other batches.

    Read from Lightning's logger connector, the way its training loop reads it right after
    `on_train_batch_end` (no public API gives a step's logged values).
    """
    accumulating = (
        trainer.fit_loop._should_accumulate() and trainer.lightning_module.automatic_optimization
    )
    if accumulating or not is_logging_step(trainer) or trainer._results is None:
        return {}
    return dict(trainer._logger_connector.metrics["log"])
