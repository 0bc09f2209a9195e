"""Export a checkpoint's network weights: `python scripts/export.py ckpt_path=... format=...`.

Writes into the run directory, with the resolved config of the training run as `config.yaml`:
- format=safetensors (the default): `model.safetensors`; format=state_dict: `model.pt`, a plain
  state dict that loads with `weights_only=True`. With the run's BPE or pretrained tokenizer
  in `tokenizer/`, so that the export is self-contained. Start a new run from them with
  `python train.py model.pretrained=<exported file>`.
- format=merged (language models): a transformers folder (config.json, model.safetensors and
  the tokenizer) that `AutoModelForCausalLM.from_pretrained` loads, LoRA adapters merged in.
- format=peft (LoRA runs, `adapter=lora`): `adapter_config.json` + `adapter_model.safetensors`,
  which `peft.PeftModel.from_pretrained` loads onto transformers' model of the base folder,
  and `python train.py ... adapter=lora adapter.path=<folder>` trains on from.
An adapter run's safetensors and state_dict exports hold the merged weights.

A folder that holds an earlier export is refused, unless `overwrite=true` says to write over it.
"""

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from src.checkpoints.export_folder import check_no_earlier_export, with_one_file_mode
from src.checkpoints.restore import Restored, restore
from src.checkpoints.weights import save_weights
from src.run.app import hydra_app
from src.run.language.hf_export import export_for_transformers, export_peft
from src.utils.contracts import HasAdapter
from src.utils.errors import ConfigError
from src.utils.weights import network_state_dict

log = logging.getLogger(__name__)
FILENAMES = {"safetensors": "model.safetensors", "state_dict": "model.pt"}
FOLDERS = ("merged", "peft")  # written by src/run/language/hf_export.py


def export(cfg: DictConfig) -> Path:
    """Write the weights, the config and the tokenizer; return the weights file's path (the
    folder for format=merged and format=peft)."""
    if cfg.format not in (*FILENAMES, *FOLDERS):
        raise ConfigError(
            f"format={cfg.format!r} is not one of {', '.join([*FILENAMES, *FOLDERS])}."
        )
    out_dir = Path(cfg.paths.output_dir)
    check_no_earlier_export(out_dir, cfg.overwrite)
    moved_base = cfg.model.pretrained
    restored = restore(cfg.ckpt_path, [f"model.pretrained='{moved_base}'"] if moved_base else [])
    with with_one_file_mode(out_dir):
        weights = write_export(restored, cfg.format, out_dir)
    log.info("Exported %s -> %s", cfg.ckpt_path, weights)
    return weights


def write_export(restored: Restored, fmt: str, out_dir: Path) -> Path:
    """Write `restored` into `out_dir` in format `fmt`; return the weights file (or the folder)."""
    if fmt in FOLDERS:
        if fmt == "merged":
            export_for_transformers(restored.model, restored.tokenizer, out_dir)
        else:
            export_peft(restored.model, out_dir)
        weights = out_dir
    else:
        weights = out_dir / FILENAMES[fmt]
        save_weights(network_state_dict(network_weights(restored.model)), weights)
    (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(restored.config))
    if restored.tokenizer is not None and fmt != "merged":
        restored.tokenizer.save(out_dir / "tokenizer")  # nothing for the byte tokenizer
    return weights


def network_weights(model) -> dict:
    """The model's state dict; for a model with an adapter (a language model), its network
    with the adapter merged in."""
    if isinstance(model, HasAdapter):
        return model.adapter.merged_network().state_dict()
    return model.state_dict()


@hydra_app("export")
def main(cfg: DictConfig) -> None:
    export(cfg)


if __name__ == "__main__":
    main()
