"""Periodic checkpoints that resume exactly wherever the step interval falls, and one at the end.

`last.ckpt` is a second name of the newest one rather than a second copy.
"""

import os
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from src.utils.files import link_atomically


class ResumableCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint, saving at the end of an epoch what is due after its last batch.

    A save due after an epoch's last batch (`every_n_train_steps`) is written at the end of that
    epoch instead, after its validation, and `save_last="link"` makes `last.ckpt` a hard link (see
    `link_atomically`). The last epoch of a fit ends with a checkpoint of its final state,
    whichever step the interval last fell on: an uninterrupted run and one resumed near its end
    leave the same files, `last.ckpt` at the final step.

    Resumed from a checkpoint written after the last batch, Lightning starts the next epoch
    without running the end of the finished one: no validation, no `on_train_epoch_end`, so the
    epoch's metrics are never logged or reset and leak into the next. Written at the epoch's
    end, the same step's checkpoint is an end-of-epoch one, which resumes exactly.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._due_at_epoch_end = False

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        # The state a fit starts from is saved already: step 0 needs no file, and a resumed
        # run's is the checkpoint it resumed from.
        self._last_global_step_saved = trainer.global_step

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch and self._step_save_due(
            trainer
        ):
            self._due_at_epoch_end = True
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        due = self._due_at_epoch_end or fit_ends_with_this_epoch(trainer)
        if due and not self._should_skip_saving_checkpoint(trainer):
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        self._due_at_epoch_end = False

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Save nothing more: the fit's final state was saved at the end of its last epoch.

        Lightning's own save here (of last.ckpt, in a fit that saved nothing else) would hold
        the weights that EMA has replaced with their average by now.
        """

    def _step_save_due(self, trainer: Trainer) -> bool:
        every = self._every_n_train_steps
        return every >= 1 and trainer.global_step % every == 0

    @staticmethod
    def _link_checkpoint(trainer: Trainer, filepath: str, linkpath: str) -> None:
        # Lightning's own removes `linkpath`, then symlinks: a kill in between leaves no last
        # checkpoint, and rotating out the step file leaves the symlink dangling. Linking again
        # to the file it names (each validation relinks) would leave the temporary link behind:
        # a rename between two names of one file does nothing.
        if trainer.is_global_zero and not same_file(filepath, linkpath):
            link_atomically(filepath, linkpath)
        trainer.strategy.barrier()


def fit_ends_with_this_epoch(trainer: Trainer) -> bool:
    """Whether the fit stops after the epoch now ending, asked at `on_train_epoch_end`.

    Lightning's `fit_loop.done` answers too, but logs and moves the epoch progress as it does.
    """
    loop = trainer.fit_loop
    steps_done = loop.max_steps != -1 and trainer.global_step >= loop.max_steps
    max_epochs = -1 if loop.max_epochs is None else loop.max_epochs
    processed = loop.epoch_progress.current.processed  # type: ignore[attr-defined]  # typed as its base
    epochs_done = max_epochs != -1 and processed >= max_epochs
    return steps_done or epochs_done or (trainer.should_stop and loop._can_stop_early)


def same_file(path: str, other: str) -> bool:
    """Whether both paths name one file (the same path, or hard links to one)."""
    return os.path.abspath(path) == os.path.abspath(other) or (
        os.path.exists(other) and os.path.samefile(path, other)
    )
