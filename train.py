"""Train a model chosen in config: `python train.py model=cnn data=mnist trainer.max_epochs=5`.

The whole run is described by `conf/train.yaml` and its groups; this file only wires the
objects Hydra builds: datamodule, model, callbacks, loggers and Trainer; fit, test, report.
"""

import logging
import time
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from lightning.pytorch import LightningModule
from omegaconf import DictConfig

from src.checkpoints.weights import check_checkpoint_fits
from src.run.app import hydra_app
from src.run.config_checks import check_config_types
from src.run.lr_scaling import apply_lr_scaling
from src.run.outputs import finish_run
from src.run.trainer import (
    build_trainer,
    check_launch,
    plain_config,
    run_overrides,
    was_preempted,
)
from src.utils.errors import MissingFileError

log = logging.getLogger(__name__)


def checked_ckpt_path(ckpt_path: str | None, model: LightningModule) -> str | None:
    """`ckpt_path` as given, after checking that a path (not Lightning's "last") exists and
    holds a checkpoint of this model."""
    if ckpt_path is None or ckpt_path == "last":
        return ckpt_path
    if Path(ckpt_path).is_file():
        check_checkpoint_fits(model, ckpt_path)
        return ckpt_path
    raise MissingFileError(
        f"ckpt_path={ckpt_path!r} does not exist. Pass a checkpoint file (e.g. "
        f"logs/train/runs/<run>/checkpoints/last.ckpt) or ckpt_path=last to resume from the "
        f"newest checkpoint of this run directory (set hydra.run.dir to reuse one)."
    )


def train(cfg: DictConfig) -> dict[str, Any]:
    """Fit (unless `train=false`), then test the best checkpoint; return metrics.json's content."""
    start = time.perf_counter()
    check_config_types(cfg)
    check_launch(cfg)
    apply_lr_scaling(cfg)
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)

    datamodule = hydra.utils.instantiate(cfg.data)
    model = hydra.utils.instantiate(cfg.model)
    trainer = build_trainer(cfg, run_config=(plain_config(cfg), run_overrides()))

    if cfg.get("train"):
        trainer.fit(
            model, datamodule=datamodule, ckpt_path=checked_ckpt_path(cfg.get("ckpt_path"), model)
        )
    metrics = dict(trainer.callback_metrics)
    preempted = was_preempted(trainer)

    best_path = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    if cfg.get("test") and not preempted:
        if not best_path:
            log.warning("No best checkpoint was saved: testing the current weights.")
        trainer.test(model, datamodule=datamodule, ckpt_path=best_path or None)
        metrics.update(trainer.callback_metrics)

    return finish_run(
        trainer,
        cfg.paths.output_dir,
        metrics,
        start,
        best_model_path=best_path or None,
        preempted=preempted,
    )


@hydra_app("train")
def main(cfg: DictConfig) -> float | None:
    record = train(cfg)
    # The value a sweeper (e.g. Optuna) optimises.
    return record.get("metrics", {}).get(cfg.get("optimized_metric"))


if __name__ == "__main__":
    main()
