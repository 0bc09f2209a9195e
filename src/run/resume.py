"""Which checkpoint `ckpt_path=` names, checked before Lightning reads it.

Lightning loads a resumed checkpoint with its own loader, and under FSDP that loader unpickles
the whole file. So `ckpt_path=last` is resolved here to the file Lightning would pick, and
every path is read weights-only (`check_checkpoint_fits`) before `trainer.fit` sees it: a file
that would run code is refused before anything unpickles it.
"""

import logging
from pathlib import Path

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from src.callbacks.preemption import Preemption
from src.checkpoints.weights import check_checkpoint_fits
from src.utils.errors import MissingFileError

log = logging.getLogger(__name__)


def last_checkpoint(trainer: Trainer) -> Path | None:
    """The newest `last*.ckpt` in the checkpoint callbacks' folders: Lightning's meaning of
    `ckpt_path="last"` (ModelCheckpoint's `last.ckpt`, the preemption save, versioned ones)."""
    folders = {
        Path(callback.dirpath)
        for callback in trainer.callbacks
        if isinstance(callback, ModelCheckpoint) and callback.dirpath
    } | {callback.path.parent for callback in trainer.callbacks if isinstance(callback, Preemption)}
    found = [path for folder in folders for path in folder.glob("last*.ckpt") if path.is_file()]
    return max(found, key=lambda path: path.stat().st_mtime, default=None)


def checked_ckpt_path(
    ckpt_path: str | None, trainer: Trainer, model: LightningModule
) -> str | None:
    """The checkpoint file to resume from (None: a fresh run), after checking weights-only that
    it exists and holds a checkpoint of this model."""
    if ckpt_path == "last":
        found = last_checkpoint(trainer)
        if found is None:
            log.info("ckpt_path=last: this run directory holds no last checkpoint yet; starting")
        ckpt_path = str(found) if found else None
    if ckpt_path is None:
        return None
    if Path(ckpt_path).is_file():
        check_checkpoint_fits(model, ckpt_path)
        return ckpt_path
    raise MissingFileError(
        f"ckpt_path={ckpt_path!r} does not exist. Pass a checkpoint file (e.g. "
        f"logs/train/runs/<run>/checkpoints/last.ckpt) or ckpt_path=last to resume from the "
        f"newest checkpoint of this run directory (set hydra.run.dir to reuse one)."
    )
