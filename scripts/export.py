"""Export a checkpoint's network weights: `python scripts/export.py ckpt_path=... format=...`.

Writes `model.safetensors` (format=safetensors, the default) or `model.pt` (format=state_dict,
a plain state dict that loads with `weights_only=True`) into the run directory, with the
resolved config of the training run as `config.yaml` and, for a run with a BPE or pretrained
tokenizer, that tokenizer in `tokenizer/`, so that the export is self-contained. Start a new
run from them with `python train.py model.pretrained=<exported file>`.
"""

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from src.checkpoints.restore import restore
from src.checkpoints.weights import save_weights
from src.run.app import hydra_app
from src.utils.errors import ConfigError
from src.utils.weights import network_state_dict

log = logging.getLogger(__name__)
FILENAMES = {"safetensors": "model.safetensors", "state_dict": "model.pt"}


def export(cfg: DictConfig) -> Path:
    """Write the weights, the config and the tokenizer; return the weights file's path."""
    if cfg.format not in FILENAMES:
        raise ConfigError(f"format={cfg.format!r} is not one of {', '.join(FILENAMES)}.")
    restored = restore(cfg.ckpt_path)
    out_dir = Path(cfg.paths.output_dir)
    weights = out_dir / FILENAMES[cfg.format]
    save_weights(network_state_dict(restored.model.state_dict()), weights)
    (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(restored.config))
    if restored.tokenizer is not None:
        restored.tokenizer.save(out_dir / "tokenizer")  # nothing for the byte tokenizer
    log.info("Exported %s -> %s", cfg.ckpt_path, weights)
    return weights


@hydra_app("export")
def main(cfg: DictConfig) -> None:
    export(cfg)


if __name__ == "__main__":
    main()
