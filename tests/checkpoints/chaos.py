"""A callback that SIGKILLs its own process at one chosen moment of a run, for the chaos test.

Add it to a run with
`+callbacks.chaos._target_=tests.checkpoints.chaos.Chaos +callbacks.chaos.moment=<moment>
+callbacks.chaos.step=<step> +callbacks.chaos.record=<file>`: the process dies at the first
`moment` it meets at or after optimizer step `step`, having appended what it died at to `record`.
"""

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from src.checkpoints import io as checkpoint_io

# Where a run can die. `checkpoint write` stops a save half-way through its temporary file;
# `first step` is the first optimizer step the process takes (after a resume, the first step of
# the resumed run); `testing` is the test stage after the last training step.
MOMENTS = ("train step", "checkpoint write", "validation", "epoch end", "first step", "testing")


class Chaos(Callback):
    """SIGKILL this process at the first `moment` at or after optimizer step `step`."""

    def __init__(self, moment: str, step: int, record: str):
        if moment not in MOMENTS:
            raise ValueError(f"moment={moment!r}: one of {', '.join(MOMENTS)}")
        self.moment, self.step, self.record = moment, step, Path(record)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.moment == "checkpoint write" and stage == "fit":
            checkpoint_io.write_atomically = self._dying_writer(
                trainer, checkpoint_io.write_atomically
            )  # type: ignore[method-assign]

    def on_train_batch_end(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        if self.moment == "first step" or self._due(trainer, "train step"):
            self._die(trainer)

    def on_validation_batch_end(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        if not trainer.sanity_checking and self._due(trainer, "validation"):
            self._die(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._due(trainer, "epoch end"):
            self._die(trainer)

    def on_test_batch_end(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        if self.moment == "testing":
            self._die(trainer)

    def _due(self, trainer: Trainer, moment: str) -> bool:
        return self.moment == moment and trainer.global_step >= self.step

    def _die(self, trainer: Trainer) -> None:
        with self.record.open("a") as file:
            file.write(f"{self.moment} at step {trainer.global_step}\n")
        os.kill(os.getpid(), signal.SIGKILL)

    def _dying_writer(self, trainer: Trainer, write_atomically: Callable) -> Callable:
        """`write_atomically` that, when a checkpoint save is due to die, writes half of it to
        the temporary file and dies there, before the rename."""

        def write(path: Any, content: Any, what: str = "file") -> None:
            if what != "checkpoint" or not self._due(trainer, "checkpoint write"):
                return write_atomically(path, content, what)

            def half_then_die(file: Any) -> None:
                content(file)
                file.truncate(file.tell() // 2)
                file.flush()
                self._die(trainer)

            return write_atomically(path, half_then_die, what)

        return write
