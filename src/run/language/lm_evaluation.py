"""Scores of a trained language model on lm-evaluation-harness tasks, kept with its run.

The checkpoint is exported as a transformers folder (`hf_export.py`) and scored by lm-eval's
`hf` wrapper, the model class its users know. lm-eval's full output goes to
`<run>/lm_eval/results.json`, and each score to `<run>/metrics.json` as `eval/<task>/<metric>`
(`eval/<task>/<metric>/<filter>` for a filter other than lm-eval's default, `none`). Task names
are looked up in the local tasks (src/run/language/lm_eval_tasks/) and the `include_path` folders,
and only then among lm-eval's own, whose datasets come from the Hugging Face Hub.
"""

import json
import logging
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Trainer
from omegaconf import DictConfig, OmegaConf

from src.checkpoints.restore import restore
from src.run.config.compose import CONF_DIR
from src.run.language.hf_export import export_for_transformers
from src.run.outputs import METRICS_FILE
from src.run.resume import last_checkpoint
from src.utils.errors import CheckpointError, ConfigError, MissingFileError
from src.utils.files import write_atomically
from src.utils.transformers_fallback import use_pytorch_kernels_in_transformers

log = logging.getLogger(__name__)

LOCAL_TASKS = Path(__file__).with_name("lm_eval_tasks")
RESULTS_FOLDER = "lm_eval"
SETTINGS_FILE = Path(CONF_DIR) / "evaluate_lm.yaml"


@dataclass(frozen=True)
class LmEvalSettings:
    """What lm-eval runs: the keys of conf/evaluate_lm.yaml (train.py's `+lm_eval.<key>`)."""

    tasks: list[str]
    include_path: list[str]
    num_fewshot: int | None
    limit: float | None
    batch_size: int | str
    device: str | None

    def __post_init__(self) -> None:
        """Refuse counts lm-eval would misread: a negative limit reads from the end."""
        if self.num_fewshot is not None and (
            not isinstance(self.num_fewshot, int) or self.num_fewshot < 0
        ):
            raise ConfigError(
                f"num_fewshot={self.num_fewshot!r}: give the number of examples shown before "
                f"each question (0 or more), or null for each task's own."
            )
        if self.limit is not None and (not isinstance(self.limit, int | float) or self.limit <= 0):
            raise ConfigError(
                f"limit={self.limit!r}: give at most how many examples per task (a whole number "
                f"of at least 1, or a fraction between 0 and 1), or null for all of them."
            )
        if self.batch_size != "auto" and (
            not isinstance(self.batch_size, int) or self.batch_size < 1
        ):
            raise ConfigError(
                f"batch_size={self.batch_size!r}: give a whole number of at least 1, or auto."
            )

    @classmethod
    def from_config(cls, cfg: DictConfig) -> "LmEvalSettings":
        values = {field.name: cfg[field.name] for field in fields(cls)}
        for key in ("tasks", "include_path"):  # `tasks=hellaswag` means one task, not letters
            value = values[key]
            values[key] = [value] if isinstance(value, str) else list(value)
        return cls(**values)

    @classmethod
    def for_training(cls, overrides: DictConfig) -> "LmEvalSettings":
        """train.py's `+lm_eval.<key>=...` over the defaults of conf/evaluate_lm.yaml."""
        known = {field.name for field in fields(cls)}
        if unknown := sorted(set(overrides) - known):
            raise ConfigError(
                f"lm_eval.{unknown[0]} is not a setting of lm-eval runs; they are "
                f"{', '.join(sorted(known))} (see conf/evaluate_lm.yaml)."
            )
        if "tasks" not in overrides:
            raise ConfigError("lm_eval needs its tasks: +lm_eval.tasks=[sft_choice] for example.")
        merged = OmegaConf.merge(OmegaConf.load(SETTINGS_FILE), overrides)
        assert isinstance(merged, DictConfig)  # conf/evaluate_lm.yaml is a mapping
        return cls.from_config(merged)


def check_lm_eval_request(cfg: DictConfig) -> None:
    """Check a `+lm_eval.tasks=[...]` request before training rather than after it.

    It fails on a key that is not a setting, a missing lm-eval, or a task lm-eval does not have.
    """
    if "lm_eval" in cfg:
        settings = LmEvalSettings.for_training(cfg.lm_eval)
        import_lm_eval()
        task_manager(settings)


def evaluate_after_training(cfg: DictConfig, trainer: Trainer, record: dict) -> dict:
    """Score the tested run's best checkpoint (else its last) on `+lm_eval.tasks=[...]`.

    Returns metrics.json's content, the scores included. Nothing happens on ranks other than 0
    (their record is empty) or in a preempted run, which has not finished.
    """
    if "lm_eval" not in cfg or not record or record.get("preempted"):
        return record
    ckpt_path = record.get("best_model_path") or last_checkpoint(trainer)
    if not ckpt_path:
        raise CheckpointError(
            "lm_eval scores a checkpoint of the run, and this run saved none: keep "
            "callbacks.last_checkpoint (or callbacks.model_checkpoint) on."
        )
    if trainer.world_size > 1:
        # lm-eval would join the run's process group and wait for ranks that have finished.
        log.warning(
            "lm_eval runs in one process, not at the end of a %d-process run: score it with "
            "python scripts/evaluate_lm.py ckpt_path=%s tasks=[...]",
            trainer.world_size,
            ckpt_path,
        )
        return record
    settings = LmEvalSettings.for_training(cfg.lm_eval)
    return evaluate_checkpoint(ckpt_path, cfg.paths.output_dir, settings)


def evaluate_checkpoint(
    ckpt_path: str | Path, run_dir: str | Path, settings: LmEvalSettings
) -> dict[str, Any]:
    """Score the checkpoint on `settings.tasks` and record the scores in the run directory.

    Writes `<run_dir>/lm_eval/results.json`, merges the scores into `<run_dir>/metrics.json` and
    returns that file's new content.
    """
    lm_eval = import_lm_eval()
    manager = task_manager(settings)  # an unknown task fails before the checkpoint loads
    restored = restore(ckpt_path)
    folder = Path(run_dir) / RESULTS_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    use_pytorch_kernels_in_transformers()
    with tempfile.TemporaryDirectory(prefix="transformers-", dir=folder) as export:
        export_for_transformers(restored.model, restored.tokenizer, Path(export))
        del restored  # the run's copy of the weights, before lm-eval loads its own
        results = lm_eval.simple_evaluate(
            model="hf",
            model_args={"pretrained": export},
            tasks=manager.match_tasks(settings.tasks),
            task_manager=manager,
            num_fewshot=settings.num_fewshot,
            limit=settings.limit,
            batch_size=settings.batch_size,
            device=settings.device or ("cuda" if torch.cuda.is_available() else "cpu"),
            log_samples=False,
        )
    results = {"ckpt_path": str(Path(ckpt_path).resolve()), **results}
    text = json.dumps(results, indent=2, default=lm_eval.utils.handle_non_serializable) + "\n"
    write_atomically(folder / "results.json", text.encode(), what="results file")
    scores = metrics_of(results["results"])
    log.info("lm-eval on %s: %s", ckpt_path, json.dumps(scores, indent=2))
    return merge_metrics(run_dir, scores)


def import_lm_eval():
    """Import lm-eval and the transformers wrapper it scores through.

    Without them, a ConfigError names the extra that installs them.
    """
    try:
        import lm_eval
        import lm_eval.models.huggingface  # needs transformers and accelerate
    except ImportError as error:
        raise ConfigError(
            f"lm-eval and the transformers wrapper it scores through are not installed "
            f'({error}): pip install -e ".[eval]"'
        ) from None
    return lm_eval


def task_manager(settings: LmEvalSettings):
    """Build lm-eval's task index over the local tasks and `include_path`.

    lm-eval's own tasks are indexed only when a name is not found there. A ConfigError names a
    task that none of them has.
    """
    from lm_eval.tasks import TaskManager

    for folder in settings.include_path:
        if not Path(folder).is_dir():
            raise MissingFileError(f"include_path: {folder!r} is not a folder of task YAMLs.")
    paths = [str(LOCAL_TASKS), *settings.include_path]
    local = TaskManager(include_path=paths, include_defaults=False)
    if not unmatched(local, settings.tasks):
        return local
    manager = TaskManager(include_path=paths)  # indexing lm-eval's own tasks takes seconds
    if missing := unmatched(manager, settings.tasks):
        raise ConfigError(
            f"tasks: lm-eval has no task {', '.join(map(repr, missing))}. The local ones are "
            f"{', '.join(local.all_tasks)}; `lm-eval ls tasks` lists lm-eval's own."
        )
    return manager


def unmatched(manager, names: list[str]) -> list[str]:
    return [name for name in names if not manager.match_tasks([name])]


def metrics_of(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """`eval/<task>/<metric>` for each number lm-eval reports as `<metric>,<filter>`."""
    scores = {}
    for task, values in results.items():
        for key, value in values.items():
            metric, comma, filter_name = key.partition(",")
            if comma and isinstance(value, int | float):
                suffix = "" if filter_name == "none" else f"/{filter_name}"
                scores[f"eval/{task}/{metric}{suffix}"] = float(value)
    return scores


def merge_metrics(run_dir: str | Path, scores: dict[str, float]) -> dict[str, Any]:
    """Add `scores` to `<run_dir>/metrics.json` (a new value replaces an old one); return it."""
    path = Path(run_dir) / METRICS_FILE
    record = json.loads(path.read_text()) if path.is_file() else {}
    record["metrics"] = dict(sorted({**record.get("metrics", {}), **scores}.items()))
    # Atomically: a reader sees the file before or after, never a part.
    write_atomically(path, (json.dumps(record, indent=2) + "\n").encode(), what="metrics file")
    return record
