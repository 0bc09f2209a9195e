"""Which checkpoint `ckpt_path=` names, checked before Lightning reads it.

Lightning loads a resumed checkpoint with its own loader, and under FSDP that loader unpickles
the whole file. So `ckpt_path=last` is resolved here to the file Lightning would pick, and
every path is read weights-only (`check_checkpoint_fits`) before `trainer.fit` sees it: a file
that would run code is refused before anything unpickles it.

`ckpt_path=last` means "the last checkpoint of this run directory". A directory this launch
has just named after the time cannot hold one, so there it is refused, naming the directories
that do, rather than silently starting afresh.
"""

import logging
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from src.callbacks.checkpointing.preemption import Preemption, resume_command
from src.checkpoints.weights import check_checkpoint_fits
from src.run.launch import in_multi_task_srun_step
from src.utils.errors import MissingFileError

log = logging.getLogger(__name__)

# How many of the newest resumable run directories a refused `ckpt_path=last` lists.
LISTED_RUNS = 5


def checkpoint_folders(trainer: Trainer) -> set[Path]:
    """The folders the checkpoint callbacks and the preemption save write to."""
    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning, undeclared on Trainer
    return {
        Path(callback.dirpath)
        for callback in callbacks
        if isinstance(callback, ModelCheckpoint) and callback.dirpath
    } | {callback.path.parent for callback in callbacks if isinstance(callback, Preemption)}


def newest_last_checkpoint(folders: set[Path]) -> Path | None:
    found = [path for folder in folders for path in folder.glob("last*.ckpt") if path.is_file()]
    return max(found, key=lambda path: path.stat().st_mtime, default=None)


def last_checkpoint(trainer: Trainer) -> Path | None:
    """Find the newest `last*.ckpt` in the checkpoint callbacks' folders.

    That is Lightning's meaning of `ckpt_path="last"`: ModelCheckpoint's `last.ckpt`, the
    preemption save, or a versioned one.
    """
    return newest_last_checkpoint(checkpoint_folders(trainer))


def fresh_run_dir() -> Path | None:
    """Return this run's directory if this launch named it after the time, else None.

    Only a time-named directory is sure to be new. None when it was pinned (`hydra.run.dir=`),
    is a multirun job's, or is named by the launcher so that a requeued or restarted job finds it
    again (srun's `slurm-<job id>`, a torchrun worker group's).
    """
    if not HydraConfig.initialized():
        return None
    config = HydraConfig.get()
    pinned = any(override.startswith("hydra.run.dir=") for override in config.overrides.hydra)
    if pinned or config.mode == RunMode.MULTIRUN:
        return None
    if TorchElasticEnvironment.detect() or in_multi_task_srun_step():
        return None
    return Path(config.runtime.output_dir)


def resumable_runs(run_dir: Path, trainer: Trainer) -> list[Path]:
    """The sibling run directories of `run_dir` that hold a last checkpoint, newest first."""
    folders = checkpoint_folders(trainer)
    relative = {folder.relative_to(run_dir) for folder in folders if folder.is_relative_to(run_dir)}
    found = []
    for sibling in run_dir.parent.iterdir():
        if sibling != run_dir and sibling.is_dir():
            last = newest_last_checkpoint({sibling / folder for folder in relative})
            if last is not None:
                found.append((last.stat().st_mtime, sibling))
    return [sibling for _, sibling in sorted(found, reverse=True)]


def refuse_last_in_fresh_run_dir(run_dir: Path, trainer: Trainer) -> MissingFileError:
    runs = resumable_runs(run_dir, trainer)
    problem = (
        f"ckpt_path=last resumes the last checkpoint of this run's directory, but {run_dir} "
        f"was just created by this launch (hydra.run.dir is not set), so it holds none."
    )
    if not runs:
        return MissingFileError(
            f"{problem} No run directory under {run_dir.parent} holds a last.ckpt: drop "
            f"ckpt_path=last to start a fresh run."
        )
    listed = ", ".join(str(run) for run in runs[:LISTED_RUNS])
    return MissingFileError(
        f"{problem} Run directories with a last.ckpt, newest first: {listed}. Resume the newest "
        f"with: {resume_command(str(runs[0]))}"
    )


def checked_ckpt_path(
    ckpt_path: str | None, trainer: Trainer, model: LightningModule
) -> str | None:
    """Return the checkpoint file to resume from (None: a fresh run), checked to fit this model.

    It is read weights-only, to check that it exists and holds a checkpoint of this model.
    """
    if ckpt_path == "last":
        found = last_checkpoint(trainer)
        if found is None:
            if (run_dir := fresh_run_dir()) is not None:
                raise refuse_last_in_fresh_run_dir(run_dir, trainer)
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
