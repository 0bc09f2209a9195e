"""Evaluate a checkpoint on the test split: `python eval.py ckpt_path=<path to .ckpt>`.

The model and the data are restored from the checkpoint (`src.checkpoints.restore`), and so
are the trainer settings that decide what a test computes (precision, test batches,
determinism): nothing about the training run needs repeating. This run's overrides of
`model.` and `data.` keys (e.g. a different `data.data_dir` or `data.batch_size`) change the
stored config; its `trainer.` overrides, callbacks and loggers are its own.
"""

import re
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict

from src.checkpoints.restore import restore
from src.run.app import hydra_app
from src.run.config.checks import check_config_types
from src.run.outputs import finish_run, log_summary
from src.run.trainer import build_trainer, run_overrides
from src.utils.errors import ConfigError, MissingFileError

# The config groups taken from the checkpoint (the rest is this run's own).
RESTORED_GROUPS = ("model", "data")
# The trainer settings that decide what a test computes: as the run had them, unless this
# command sets them.
TEST_SETTINGS = ("precision", "limit_test_batches", "deterministic")


def group_of(override: str) -> str:
    """The top-level key an override changes: `data` for `data.batch_size=8` or `data=mnist`."""
    return re.split(r"[.=@]", override.lstrip("+~"))[0]


def stored_config_overrides(overrides: list[str]) -> list[str]:
    """The overrides of the restored groups, for the checkpoint's stored config. A key that the
    default config lacks needs a `+` on this command line; on the stored config it sets the key
    whether or not it is there (`++`)."""
    picked = [override for override in overrides if group_of(override) in RESTORED_GROUPS]
    return [re.sub(r"^\+(?!\+)", "++", override) for override in picked]


def use_test_settings_of_the_run(cfg: DictConfig, stored_trainer: DictConfig) -> None:
    """Copy the run's TEST_SETTINGS into this run's trainer config, except those that this
    command line sets itself (or that its `trainer=<option>` choice sets)."""
    overrides = run_overrides()
    if any(override.lstrip("+").startswith("trainer=") for override in overrides):
        return
    given = {override.lstrip("+~").split("=")[0] for override in overrides}
    with open_dict(cfg):
        for key in TEST_SETTINGS:
            if f"trainer.{key}" not in given and key in stored_trainer:
                cfg.trainer[key] = stored_trainer[key]


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Test the checkpoint at `cfg.ckpt_path`; return metrics.json's content."""
    start = time.perf_counter()
    if cfg.get("ckpt_path") is None:  # `???` merged over train.yaml's `ckpt_path: null`
        raise ConfigError(
            "Required config value not set: ckpt_path. Set it on the command line: "
            "ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt"
        )
    ckpt_path = Path(cfg.ckpt_path)
    if not ckpt_path.is_file():
        raise MissingFileError(
            f"ckpt_path={str(ckpt_path)!r} is not a file. Pass a checkpoint written by train.py, "
            f"e.g. ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt"
        )
    restored = restore(ckpt_path, stored_config_overrides(run_overrides()))
    use_test_settings_of_the_run(cfg, restored.config.trainer)
    check_config_types(cfg)
    trainer = build_trainer(cfg)
    trainer.test(restored.model, datamodule=restored.datamodule)

    record = finish_run(
        trainer,
        cfg.paths.output_dir,
        trainer.callback_metrics,
        start,
        ckpt_path=str(ckpt_path.resolve()),
    )
    log_summary(record, cfg.paths.output_dir)
    return record


@hydra_app("eval")
def main(cfg: DictConfig) -> None:
    evaluate(cfg)


if __name__ == "__main__":
    main()
