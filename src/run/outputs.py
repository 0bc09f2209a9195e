"""What a run leaves next to its checkpoints: metrics.json and a short console summary."""

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from src.callbacks.measurement.class_report import ClassReport
from src.callbacks.measurement.throughput import Throughput
from src.utils.files import write_atomically
from src.utils.lightning import as_number
from src.utils.tensor_bytes import module_bytes

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.json"
PARAMETER_BYTES = "model/parameter_bytes"  # the model's tensors as stored, in every record


def write_metrics(
    output_dir: str | Path, metrics: Mapping[str, Any], **extra: Any
) -> dict[str, Any]:
    """Write `<output_dir>/metrics.json`: {"metrics": {key as logged: value}, **extra}."""
    record = {"metrics": {key: as_number(value) for key, value in sorted(metrics.items())}}
    record.update(extra)
    text = json.dumps(record, indent=2) + "\n"
    write_atomically(Path(output_dir) / METRICS_FILE, text.encode(), what="metrics")
    return record


def finish_run(
    trainer: Any, output_dir: str | Path, metrics: Mapping[str, Any], start: float, **extra: Any
) -> dict[str, Any]:
    """Write metrics.json (with the wall time since `start`) on rank 0; return its content.

    The metrics gain `model/parameter_bytes`, the bytes of the model's parameters and buffers
    as stored (a 4-bit weight at its packed size). Other ranks write nothing and get an empty
    record. The caller prints the summary (`log_summary`) once the record holds all it reports
    (lm-eval's scores after training).
    """
    if not trainer.is_global_zero:
        return {}
    wall_time_s = round(time.perf_counter() - start, 3)
    if (model := trainer.lightning_module) is not None:
        metrics = {**metrics, PARAMETER_BYTES: module_bytes(model)}
    if (peak := mfu_peak(trainer)) is not None:
        extra["mfu_peak"] = peak
    if accuracy := test_acc_per_class(trainer):
        extra["test_acc_per_class"] = accuracy
    return write_metrics(output_dir, metrics, **extra, wall_time_s=wall_time_s)


def mfu_peak(trainer: Any) -> dict[str, Any] | None:
    """The peak FLOP/s that `perf/mfu` was measured against, and where it comes from."""
    for callback in trainer.callbacks:
        if isinstance(callback, Throughput) and callback.peak is not None:
            return {"flops_per_s": callback.peak.flops, "source": callback.peak.source}
    return None


def test_acc_per_class(trainer: Any) -> dict[str, float | None]:
    """{class: accuracy} of the last test, from the ClassReport callback ({} without one)."""
    for callback in trainer.callbacks:
        if isinstance(callback, ClassReport):
            return callback.accuracy
    return {}


def log_summary(record: Mapping[str, Any], output_dir: str | Path) -> None:
    """Print the metrics worth reading at a glance and where everything went.

    Other ranks than 0 have empty records and print nothing.
    """
    if not record:
        return
    lines = [
        f"  {key:<24} {value:.4f}"
        for key, value in record["metrics"].items()
        if isinstance(value, float) and key.split("/")[0] in ("val", "test", "eval")
    ]
    for key in ("best_model_path", "wall_time_s"):
        if record.get(key) not in (None, ""):
            lines.append(f"  {key:<24} {record[key]}")
    lines.append(f"  {'output_dir':<24} {output_dir}")
    log.info("Run summary:\n%s", "\n".join(lines))
