"""Save a checkpoint and stop cleanly when the job is asked to stop (SIGTERM, SIGUSR1).

The signal handler only raises a flag; the checkpoint is written at the next batch boundary,
never from inside the handler, where it could capture a half-finished optimizer step.
"""

import logging
import os
import signal
import subprocess
import threading
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer

log = logging.getLogger(__name__)


class Preemption(Callback):
    """On SIGTERM/SIGUSR1: write `<dirpath>/<filename>` after the current step, then stop.

    With `requeue=true` inside a SLURM job, the job is also requeued (`scontrol requeue`), so
    it resumes with `ckpt_path=last` in the same run directory.
    """

    def __init__(
        self,
        dirpath: str,
        filename: str = "last.ckpt",
        signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1"),
        requeue: bool = False,
    ):
        self.path = Path(dirpath) / filename
        self.signals = [getattr(signal, name) for name in signals if hasattr(signal, name)]
        self.requeue = requeue
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be installed from the main thread
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._flag)

    def _flag(self, signum: int, frame: object) -> None:
        self.received = signum

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args) -> None:
        if self.received is None:
            return
        name = signal.Signals(self.received).name
        trainer.save_checkpoint(self.path)
        log.warning(
            "%s received: saved %s at step %d and stopping.", name, self.path, trainer.global_step
        )
        trainer.should_stop = True
        if self.requeue and "SLURM_JOB_ID" in os.environ and trainer.is_global_zero:
            subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=False)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
