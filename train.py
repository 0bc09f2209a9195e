"""Train a model chosen in config: `python train.py model=cnn data=mnist trainer.max_epochs=5`.

The whole run is described by `conf/train.yaml` and its groups; this file only wires the
objects Hydra builds: datamodule, model, callbacks, loggers and Trainer; fit, test, report.
"""

import logging
import time
from typing import Any

import lightning as L
from omegaconf import DictConfig

from src.run.app import hydra_app
from src.run.config.checks import check_config_types
from src.run.config.explicit import record_explicit_model_config
from src.run.config.instantiate import instantiate_config
from src.run.lr_scaling import apply_lr_scaling
from src.run.metric_keys import check_metric_keys
from src.run.outputs import finish_run, log_summary
from src.run.resume import checked_ckpt_path
from src.run.search.objective import optimized_value
from src.run.trainer import (
    build_trainer,
    check_launch,
    plain_config,
    run_overrides,
    was_interrupted,
    was_preempted,
)

log = logging.getLogger(__name__)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Fit (unless `train=false`), then test the best checkpoint (and score it with lm-eval when
    `+lm_eval.tasks=[...]` asks); return metrics.json's content."""
    start = time.perf_counter()
    check_config_types(cfg)
    check_launch(cfg)
    if "lm_eval" in cfg:
        # Imported when asked for: with the export to transformers it costs 0.1 s at start-up.
        from src.run.language.lm_evaluation import check_lm_eval_request

        check_lm_eval_request(cfg)
    apply_lr_scaling(cfg)
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)

    datamodule = instantiate_config(cfg.data)
    record_explicit_model_config(cfg, run_overrides())
    model = instantiate_config(cfg.model)
    trainer = build_trainer(cfg, run_config=(plain_config(cfg), run_overrides()))
    check_metric_keys(cfg, model, datamodule, trainer.callbacks)

    if cfg.get("train"):
        ckpt_path = checked_ckpt_path(cfg.get("ckpt_path"), trainer, model)
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    metrics = dict(trainer.callback_metrics)
    preempted = was_preempted(trainer)

    best_path = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    if cfg.get("test") and not preempted:
        if not best_path:
            log.warning("No best checkpoint was saved: testing the current weights.")
        trainer.test(model, datamodule=datamodule, ckpt_path=best_path or None)
        metrics.update(trainer.callback_metrics)

    record = finish_run(
        trainer,
        cfg.paths.output_dir,
        metrics,
        start,
        best_model_path=best_path or None,
        preempted=preempted,
        interrupted=was_interrupted(trainer),
    )
    if "lm_eval" in cfg:
        from src.run.language.lm_evaluation import evaluate_after_training

        record = evaluate_after_training(cfg, trainer, record)
    log_summary(record, cfg.paths.output_dir)
    return record


@hydra_app("train")
def main(cfg: DictConfig) -> float | tuple | None:
    record = train(cfg)
    # The value a sweeper (e.g. Optuna) optimises: a tuple for a list of metrics.
    return optimized_value(record.get("metrics", {}), cfg.get("optimized_metric"))


if __name__ == "__main__":
    main()
