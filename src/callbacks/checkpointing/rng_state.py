"""Save every random number generator's state in checkpoints and restore it on resume.

Lightning checkpoints hold no RNG state, so a resumed run draws different dropout masks,
augmentations and shuffles than the uninterrupted run would have. The states are stored as
tensors and plain values (safe under `weights_only=True`).

When they are put back matters as much as what they are. Building a training iterator draws
its base seed from the global torch generator. A run saved mid-epoch had already built its
iterator, and the resumed run builds one before `on_train_start`: restoring there undoes that
extra draw. A run saved between epochs (the default end-of-epoch checkpoint) had not yet built
the next epoch's: its states go back in `on_fit_start`, so that the resumed run builds it from
them, draw included, as the uninterrupted run did. (The sanity check in between runs under
Lightning's `isolate_rng` and leaves them alone.) So does a run saved after an epoch's last
batch (a periodic `every_n_train_steps` checkpoint that falls there): Lightning resumes it as
the start of the next epoch, skipping the rest of the epoch's end, and the iterator it builds
first is that epoch's. (The validation it skips would have drawn one seed for its iterator;
Lightning's fast-forward over that validation draws the same one.)
"""

import random
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer


def capture_rng_states() -> dict[str, Any]:
    """Python, NumPy, torch CPU and (when present) CUDA generator states as plain data."""
    version, python_state, gauss = random.getstate()
    kind, keys, position, has_gauss, cached = np.random.get_state()
    states = {
        "python": [version, list(python_state), gauss],
        # The global generator is the legacy MT19937 one, whose state is a tuple (never a dict).
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached],  # type: ignore[attr-defined]
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    version, python_state, gauss = states["python"]
    random.setstate((version, tuple(python_state), gauss))
    kind, keys, position, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class RNGState(Callback):
    """Checkpoints the RNG states and puts them back on resume.

    They are put back at the point of the loop where they were saved.
    """

    def __init__(self):
        self._pending: dict[str, Any] | None = None
        self._between_epochs = False

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._between_epochs = False

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args) -> None:
        # Before the checkpoint callbacks (Lightning runs them last) and Preemption (listed after).
        self._between_epochs = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._between_epochs = True

    def state_dict(self) -> dict[str, Any]:
        return {**capture_rng_states(), "between_epochs": self._between_epochs}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._pending is not None and self._pending.get("between_epochs"):
            self._restore(self._pending)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._pending is not None:
            self._restore(self._pending)

    def _restore(self, states: dict[str, Any]) -> None:
        restore_rng_states(states)
        self._pending = None
