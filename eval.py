"""Evaluate a checkpoint on the test split: `python eval.py ckpt_path=<path to .ckpt>`.

The checkpoint carries the config of the run that wrote it, so the same model and data are
rebuilt without repeating the training overrides; overrides given here (e.g. a different
`data.data_dir` or `data.batch_size`) still apply on top.
"""

import logging
import time
import warnings
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from src.checkpoints.io import load_checkpoint
from src.run.app import hydra_app
from src.run.config_checks import check_config_types
from src.run.outputs import finish_run
from src.run.trainer import build_trainer, run_overrides
from src.utils.errors import MissingFileError

log = logging.getLogger(__name__)

# Testing needs none of the training callbacks that Lightning would otherwise ask for.
warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`")

# Training overrides that describe how training ran, not what the checkpoint is (keys and the
# callbacks that eval.yaml switches off).
NOT_REPLAYED = (
    "ckpt_path",
    "debug",
    "train",
    "test",
    "hydra",
    "seed",
    "callbacks.model_checkpoint",
    "callbacks.lr_monitor",
)


def is_replayed(override: str) -> bool:
    key = override.lstrip("+~").split("=")[0]
    return not any(key == skip or key.startswith(f"{skip}.") for skip in NOT_REPLAYED)


def config_of_checkpoint(cfg: DictConfig, ckpt_path: Path) -> DictConfig:
    """Compose the eval config as the checkpoint's run was, plus this run's overrides.

    The model node is taken verbatim from the checkpoint's resolved config, since the weights
    only fit the architecture that produced them.
    """
    stored = load_checkpoint(ckpt_path).get("run_config")
    if stored is None:
        log.warning("%s records no run config: using the model and data given here.", ckpt_path)
        return cfg
    replayed = [override for override in stored["overrides"] if is_replayed(override)]
    composed = hydra.compose(config_name="eval", overrides=replayed + run_overrides())
    OmegaConf.update(composed, "model", stored["config"]["model"], merge=False)
    return composed


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Test the checkpoint at `cfg.ckpt_path`; return metrics.json's content."""
    start = time.perf_counter()
    ckpt_path = Path(cfg.ckpt_path)
    if not ckpt_path.is_file():
        raise MissingFileError(
            f"ckpt_path={str(ckpt_path)!r} is not a file. Pass a checkpoint written by train.py, "
            f"e.g. ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt"
        )
    cfg = config_of_checkpoint(cfg, ckpt_path)
    check_config_types(cfg)
    datamodule = hydra.utils.instantiate(cfg.data)
    model = hydra.utils.instantiate(cfg.model)
    trainer = build_trainer(cfg)
    trainer.test(model, datamodule=datamodule, ckpt_path=str(ckpt_path))

    return finish_run(
        trainer,
        cfg.paths.output_dir,
        trainer.callback_metrics,
        start,
        ckpt_path=str(ckpt_path.resolve()),
    )


@hydra_app("eval")
def main(cfg: DictConfig) -> None:
    evaluate(cfg)


if __name__ == "__main__":
    main()
