"""Score a trained language model on lm-evaluation-harness tasks:
`python scripts/evaluate_lm.py ckpt_path=<run>/checkpoints/last.ckpt tasks=[sft_choice]`.

The checkpoint is exported as a transformers folder and scored by lm-eval's `hf` wrapper
(`src/run/language/lm_evaluation.py`). The results go to the run the checkpoint belongs to, the
folder above its `checkpoints/` (else this command's own run directory): `lm_eval/results.json`, and
`eval/<task>/<metric>` in its `metrics.json`. Settings: conf/evaluate_lm.yaml.
"""

from pathlib import Path

from omegaconf import DictConfig

from src.run.app import hydra_app
from src.run.language.lm_evaluation import LmEvalSettings, evaluate_checkpoint


def run_dir_of(ckpt_path: Path, default: str) -> Path:
    """The training run a checkpoint was saved in (`<run>/checkpoints/<name>.ckpt`)."""
    return ckpt_path.parent.parent if ckpt_path.parent.name == "checkpoints" else Path(default)


@hydra_app("evaluate_lm")
def main(cfg: DictConfig) -> None:
    ckpt_path = Path(cfg.ckpt_path)
    settings = LmEvalSettings.from_config(cfg)
    evaluate_checkpoint(ckpt_path, run_dir_of(ckpt_path, cfg.paths.output_dir), settings)


if __name__ == "__main__":
    main()
