"""Periodic checkpoints that resume exactly wherever the step interval falls.

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
    `link_atomically`).

    Resumed from a checkpoint written after the last batch, Lightning starts the next epoch
    without running the end of the finished one: no validation, no `on_train_epoch_end`, so the
    epoch's metrics are never logged or reset and leak into the next. Written at the epoch's
    end, the same step's checkpoint is an end-of-epoch one, which resumes exactly.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._due_at_epoch_end = False

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
        if self._due_at_epoch_end and not self._should_skip_saving_checkpoint(trainer):
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        self._due_at_epoch_end = False

    def _step_save_due(self, trainer: Trainer) -> bool:
        every = self._every_n_train_steps
        return every >= 1 and trainer.global_step % every == 0

    @staticmethod
    def _link_checkpoint(trainer: Trainer, filepath: str, linkpath: str) -> None:
        # Lightning's own removes `linkpath`, then symlinks: a kill in between leaves no last
        # checkpoint, and rotating out the step file leaves the symlink dangling.
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            link_atomically(filepath, linkpath)
        trainer.strategy.barrier()
