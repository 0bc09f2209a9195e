"""Save a checkpoint and stop cleanly when the job is asked to stop or the user presses Ctrl-C.

The job is asked to stop by SIGTERM, SIGUSR1 or SIGUSR2; Ctrl-C is SIGINT.

The signal handler only raises a flag; the checkpoint is written at the next batch boundary,
never from inside the handler, where it could capture a half-finished optimizer step.
"""

import logging
import os
import shlex
import signal
import subprocess
import threading
from pathlib import Path
from types import FrameType

from hydra.core.hydra_config import HydraConfig
from lightning.pytorch import Callback, LightningModule, Trainer

log = logging.getLogger(__name__)


class Preemption(Callback):
    """On one of `signals` or `interrupts`: save after the current step, say how to resume, stop.

    After an epoch's last step, the save is at the end of the epoch, after its validation.

    The checkpoint is `<dirpath>/<filename>`, and the command that resumes from it is printed.
    A second signal of `interrupts` (Ctrl-C pressed again) stops at once, without the save.
    With `requeue=true` inside a SLURM job, the job is also requeued (`scontrol requeue`), so
    it resumes with `ckpt_path=last` in the same run directory. For the signals in
    `hand_over` (SIGUSR2: submitit's time-limit warning, used by `hydra/launcher=slurm`), the
    handler that was installed before this one runs after the save, so the launcher requeues
    the job the way it would have, now with a fresh checkpoint to resume from.
    """

    def __init__(
        self,
        dirpath: str,
        filename: str = "last.ckpt",
        signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1", "SIGUSR2"),
        requeue: bool = False,
        hand_over: tuple[str, ...] = ("SIGUSR2",),
        interrupts: tuple[str, ...] = ("SIGINT",),
    ):
        self.path = Path(dirpath) / filename
        self.interrupts = _signals(interrupts)
        self.signals = _signals(signals) | self.interrupts
        self.requeue = requeue
        self.hand_over = _signals(hand_over)
        self.received: int | None = None
        self.saved = False
        self._previous: dict[int, signal._HANDLER] = {}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be installed from the main thread
        for signum in sorted(self.signals):
            self._previous[signum] = signal.signal(signum, self._flag)

    def _flag(self, signum: int, frame: FrameType | None) -> None:
        if signum in self.interrupts and self.received is not None:
            signal.default_int_handler(signum, frame)  # KeyboardInterrupt: stop now
        self.received = signum
        if signum in self.interrupts:
            log.warning("Interrupted: saving after this step (press Ctrl-C again to stop now).")

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args) -> None:
        # After an epoch's last batch the save waits for the epoch's end, past its validation,
        # as ResumableCheckpoint's do: resumed from there, the epoch would never be validated.
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            return
        self._save_and_stop(trainer, mid_epoch=True)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._save_and_stop(trainer, mid_epoch=False)

    def _save_and_stop(self, trainer: Trainer, mid_epoch: bool) -> None:
        if self.received is None or self.saved:
            return
        name = signal.Signals(self.received).name
        # Saved atomically: a new file renamed over `last.ckpt`, so the periodic checkpoint that
        # `last.ckpt` was a hard link to keeps the state of its own step.
        trainer.save_checkpoint(self.path)
        self.saved = True
        log.warning(
            "%s received: saved %s at step %d and stopping. Resume with:\n  %s",
            name,
            self.path,
            trainer.global_step,
            resume_command(trainer.default_root_dir),
        )
        trainer.should_stop = True
        # Stop now: Lightning would otherwise train on until min_epochs / min_steps are met.
        trainer.fit_loop.min_epochs = trainer.fit_loop.epoch_loop.min_steps = 0
        # Mid-epoch, tell the checkpoint callbacks that this step and last.ckpt are saved (the
        # state their own saves keep), so that their saves at the end of the cut-short epoch and
        # of training do not replace last.ckpt with one that calls the epoch complete: a resumed
        # run would skip the rest of it. At an epoch's end their saves (the best checkpoint by
        # this epoch's validation, the final state) come after this one, and are right.
        for callback in trainer.checkpoint_callbacks if mid_epoch else ():
            # ModelCheckpoint's own bookkeeping, which the Checkpoint base class does not declare.
            callback._last_global_step_saved = trainer.global_step  # type: ignore[attr-defined]
            callback._last_checkpoint_saved = str(self.path)  # type: ignore[attr-defined]
        if self.requeue and "SLURM_JOB_ID" in os.environ and trainer.is_global_zero:
            subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=False)
        previous = self._previous.get(self.received)
        if self.received in self.hand_over and callable(previous):
            previous(self.received, None)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def _signals(names: tuple[str, ...]) -> set[int]:
    """The signal numbers of `names` that this platform has."""
    return {getattr(signal, name) for name in names if hasattr(signal, name)}


def resume_command(run_dir: str) -> str:
    """`python <script> <this run's overrides> hydra.run.dir=<run_dir> ckpt_path=last`."""
    overrides, script = [], "train.py"
    if HydraConfig.initialized():
        config = HydraConfig.get()
        script = f"{config.job.name}.py"
        overrides = [
            override
            for override in config.overrides.task
            if not override.startswith(("ckpt_path=", "hydra.run.dir="))
        ]
    words = ["python", script, *overrides, f"hydra.run.dir={run_dir}", "ckpt_path=last"]
    return shlex.join(words)
