"""What a run leaves next to its checkpoints: metrics.json and a short console summary."""

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from src.utils.lightning import as_number

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.json"


def write_metrics(
    output_dir: str | Path, metrics: Mapping[str, Any], **extra: Any
) -> dict[str, Any]:
    """Write `<output_dir>/metrics.json`: {"metrics": {key as logged: value}, **extra}."""
    record = {"metrics": {key: as_number(value) for key, value in sorted(metrics.items())}}
    record.update(extra)
    path = Path(output_dir) / METRICS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return record


def finish_run(
    trainer: Any, output_dir: str | Path, metrics: Mapping[str, Any], start: float, **extra: Any
) -> dict[str, Any]:
    """On rank 0: write metrics.json (with the wall time since `start`) and print the summary.
    Other ranks write nothing and get an empty record."""
    if not trainer.is_global_zero:
        return {}
    wall_time_s = round(time.perf_counter() - start, 3)
    record = write_metrics(output_dir, metrics, **extra, wall_time_s=wall_time_s)
    log_summary(record, output_dir)
    return record


def log_summary(record: Mapping[str, Any], output_dir: str | Path) -> None:
    """Print the metrics worth reading at a glance and where everything went."""
    lines = [
        f"  {key:<24} {value:.4f}"
        for key, value in record["metrics"].items()
        if isinstance(value, float) and key.split("/")[0] in ("val", "test")
    ]
    for key in ("best_model_path", "wall_time_s"):
        if record.get(key) not in (None, ""):
            lines.append(f"  {key:<24} {record[key]}")
    lines.append(f"  {'output_dir':<24} {output_dir}")
    log.info("Run summary:\n%s", "\n".join(lines))
