"""A Hydra callback that tabulates a multirun when it ends: overrides -> metrics, best job."""

import csv
import json
import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from src.utils.run_files import METRICS_FILE

log = logging.getLogger(__name__)


class SweepSummary(Callback):
    """Writes `summary.csv` (every metric of every job) and `summary.md` in the sweep directory.

    Each job is read back from its own `metrics.json` and `.hydra/overrides.yaml`, so the
    summary works the same for the basic launcher, process pools and cluster launchers.
    """

    def __init__(self, metric: str | None = None, mode: str = "max"):
        self.metric = metric
        self.mode = mode

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = collect_jobs(sweep_dir)
        if not rows:
            log.warning("No job of the sweep in %s wrote %s.", sweep_dir, METRICS_FILE)
            return
        write_csv(rows, sweep_dir / "summary.csv")
        best = self.best_job(rows)
        (sweep_dir / "summary.md").write_text(markdown_table(rows, self.metric, best))
        log.info("Sweep summary: %s (best job: %s)", sweep_dir / "summary.md", best)

    def best_job(self, rows: list[dict[str, Any]]) -> str | None:
        scored = [row for row in rows if isinstance(row.get(self.metric), int | float)]
        if not scored:
            return None
        pick = max if self.mode == "max" else min
        return pick(scored, key=lambda row: row[self.metric])["job"]


def collect_jobs(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job directory: job number, overrides, status and its metrics."""
    rows = []
    job_dirs = [path for path in sweep_dir.iterdir() if (path / ".hydra").is_dir()]
    for job_dir in sorted(job_dirs, key=lambda path: (len(path.name), path.name)):
        overrides = OmegaConf.load(job_dir / ".hydra" / "overrides.yaml")
        row: dict[str, Any] = {"job": job_dir.name, "overrides": " ".join(overrides)}
        metrics_file = job_dir / METRICS_FILE
        if metrics_file.exists():
            record = json.loads(metrics_file.read_text())
            row.update(status="ok", wall_time_s=record.get("wall_time_s"), **record["metrics"])
        else:
            row["status"] = "no metrics (failed or still running)"
        rows.append(row)
    return rows


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def markdown_table(rows: list[dict[str, Any]], metric: str | None, best: str | None) -> str:
    """The jobs as a Markdown table: overrides, the sweep's metric first, then test metrics."""
    metric_columns = [metric] if metric else []
    metric_columns += sorted({key for row in rows for key in row if key.startswith("test/")})
    header = ["job", "overrides", *metric_columns, "wall_time_s", "status"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [_cell(row.get(column)) for column in header]
        if row["job"] == best:
            cells[0] += " (best)"
        lines.append("| " + " | ".join(cells) + " |")
    title = (
        f"# Sweep summary\n\nBest job by `{metric}`: {best}\n\n"
        if metric
        else "# Sweep summary\n\n"
    )
    return title + "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    return "" if value is None else str(value)
