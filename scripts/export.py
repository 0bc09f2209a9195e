"""Export a checkpoint's network weights: `python scripts/export.py ckpt_path=... format=...`.

Writes `model.safetensors` (format=safetensors, the default) or `model.pt` (format=state_dict,
a plain state dict that loads with `weights_only=True`) into the run directory, with the
resolved config of the training run as `config.yaml` next to it. Start a new run from them
with `python train.py model.pretrained=<exported file>`.
"""

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from src.checkpoints.io import load_checkpoint
from src.checkpoints.weights import network_state_dict, save_weights
from src.run.app import hydra_app
from src.utils.errors import ConfigError

log = logging.getLogger(__name__)
FILENAMES = {"safetensors": "model.safetensors", "state_dict": "model.pt"}


def export(cfg: DictConfig) -> Path:
    """Write the weights and the config; return the weights file's path."""
    if cfg.format not in FILENAMES:
        raise ConfigError(f"format={cfg.format!r} is not one of {', '.join(FILENAMES)}.")
    checkpoint = load_checkpoint(cfg.ckpt_path)
    out_dir = Path(cfg.paths.output_dir)
    weights = out_dir / FILENAMES[cfg.format]
    save_weights(network_state_dict(checkpoint), weights)
    run_config = checkpoint.get("run_config", {}).get("config")
    if run_config is not None:
        (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(run_config))
    log.info("Exported %s -> %s", cfg.ckpt_path, weights)
    return weights


@hydra_app("export")
def main(cfg: DictConfig) -> None:
    export(cfg)


if __name__ == "__main__":
    main()
