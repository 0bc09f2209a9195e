"""Tabulate a multirun when it ends, as a Hydra callback.

Overrides -> metrics and the best job; for an Optuna search, each trial's state and each
parameter's importance.
"""

import csv
import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from src.run.outputs import METRICS_FILE
from src.utils.error_boundary import read_job_error

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

log = logging.getLogger(__name__)


class SweepSummary(Callback):
    """Write `summary.csv`, `summary.md` and `summary.png` in the sweep directory.

    The CSV holds every metric of every job; the plot shows the metric against each swept
    parameter. Each job is read back from its own `metrics.json` and `.hydra/overrides.yaml`, so
    the summary works the same for any sweeper and launcher.

    - `mode`: "max" or "min" ("maximize"/"minimize" too, so that it can follow Optuna's sweeper).
    - `storage` and `study_name` of an Optuna search, whose job numbers are its trial numbers:
      each job also gets its trial's state (a pruned trial is never the best), and the summary
      the importance of each parameter.
    """

    def __init__(
        self,
        metric: str | None = None,
        mode: str = "max",
        storage: str | None = None,
        study_name: str | None = None,
    ):
        self.metric = metric
        self.mode = mode
        self.storage = storage
        self.study_name = study_name

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Write the summary; then, if any job failed, end the sweep with exit status 1."""
        sweep_dir = Path(config.hydra.sweep.dir)
        rows, params = collect_jobs(sweep_dir)
        if not rows:
            log.warning("No job of the sweep in %s started.", sweep_dir)
            return
        importances: dict[str, float] = {}
        if self.storage and self.study_name:
            from src.run.search.study import load_study_report  # optuna: searches only

            states, importances = load_study_report(self.storage, self.study_name)
            for row in rows:
                row["state"] = states.get(int(row["job"])) if row["job"].isdigit() else None
        write_csv(rows, sweep_dir / "summary.csv")
        best = self.best_job(rows)
        text = markdown_table(rows, self.metric, best)
        if self.metric and params and any(_is_number(row.get(self.metric)) for row in rows):
            plot_metric(rows, self.metric, params).savefig(sweep_dir / "summary.png")
            text += f"\n![{self.metric} against each swept parameter](summary.png)\n"
        text += importance_table(importances)
        (sweep_dir / "summary.md").write_text(text)
        log.info("Sweep summary: %s (best job: %s)", sweep_dir / "summary.md", best)
        failed = [row["job"] for row in rows if row["status"] != "ok"]
        if failed:
            raise SystemExit(
                f"Error: {len(failed)} of {len(rows)} jobs of the sweep failed (job "
                f"{', '.join(failed)}): their errors are in {sweep_dir / 'summary.md'}."
            )

    def best_job(self, rows: list[dict[str, Any]]) -> str | None:
        metric = self.metric
        if metric is None:
            return None
        scored = [
            row
            for row in rows
            if _is_number(row.get(metric)) and row.get("state", "COMPLETE") == "COMPLETE"
        ]
        if not scored:
            return None
        pick = min if self.mode.startswith("min") else max
        return pick(scored, key=lambda row: row[metric])["job"]


def collect_jobs(sweep_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Read one row per job directory, and the swept parameters.

    A row holds the job number, overrides, the swept parameters' values, status and metrics. The
    swept parameters are the overrides whose value differs between jobs.
    """
    job_dirs = [path for path in sweep_dir.iterdir() if (path / ".hydra").is_dir()]
    job_dirs.sort(key=lambda path: (len(path.name), path.name))
    overrides = [list(OmegaConf.load(path / ".hydra" / "overrides.yaml")) for path in job_dirs]
    values = [override_values(job_overrides) for job_overrides in overrides]
    params = swept_params(values)
    rows = []
    for job_dir, job_overrides, job_values in zip(job_dirs, overrides, values, strict=True):
        row: dict[str, Any] = {"job": job_dir.name, "overrides": " ".join(job_overrides)}
        row.update({param: job_values.get(param) for param in params})
        metrics_file = job_dir / METRICS_FILE
        if metrics_file.exists():
            record = json.loads(metrics_file.read_text())
            row.update(status="ok", wall_time_s=record.get("wall_time_s"), **record["metrics"])
        else:
            error = read_job_error(job_dir)
            row["status"] = f"failed: {error}" if error else f"failed: no {METRICS_FILE} (killed?)"
        rows.append(row)
    return rows, params


def override_values(overrides: list[str]) -> dict[str, Any]:
    """`key=value` overrides as {key: value}, the values typed as Hydra parses them."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    return {override.get_key_element(): override.value() for override in parsed}


def swept_params(values: list[dict[str, Any]]) -> list[str]:
    """The keys, in command-line order, that do not have the same value in every job."""
    keys = dict.fromkeys(key for job_values in values for key in job_values)
    return [key for key in keys if len({repr(job.get(key)) for job in values}) > 1]


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
    states = ["state"] if any("state" in row for row in rows) else []
    header = ["job", "overrides", *metric_columns, "wall_time_s", "status", *states]
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


def importance_table(importances: dict[str, float]) -> str:
    """Write Optuna's importance of each parameter as a Markdown section (empty without any).

    Optuna's default evaluator computes them over the complete trials; they sum to 1.
    """
    if not importances:
        return ""
    lines = ["| parameter | importance |", "|---|---|"]
    lines += [f"| {name} | {value:.3f} |" for name, value in importances.items()]
    return "\n## Parameter importance (Optuna)\n\n" + "\n".join(lines) + "\n"


def plot_metric(rows: list[dict[str, Any]], metric: str, params: list[str]) -> "Figure":
    """Plot `metric` against each parameter, one subplot each.

    Numbers go on a scatter (log x-axis when they span more than 10x), anything else as
    categories. Jobs without the metric are left out.
    """
    # matplotlib: imported only when a sweep has something to plot.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    scored = [row for row in rows if _is_number(row.get(metric))]
    ncols = min(len(params), 3)
    nrows = math.ceil(len(params) / ncols)
    figure = Figure(figsize=(4 * ncols, 3.2 * nrows))
    FigureCanvasAgg(figure)  # render with Agg, without pyplot's global state
    for index, param in enumerate(params):
        axis = figure.add_subplot(nrows, ncols, index + 1)
        x = [row.get(param) for row in scored]
        y = [row[metric] for row in scored]
        if all(_is_number(value) for value in x):
            _scatter_numbers(axis, cast(list[float], x), y)
        else:
            _scatter_categories(axis, x, y)
        axis.set(xlabel=param, ylabel=metric)
        axis.grid(alpha=0.3)
    figure.tight_layout()
    return figure


def _scatter_numbers(axis: "Axes", x: list[float], y: list[float]) -> None:
    """A scatter, on a log x-axis when x spans more than 10x."""
    from matplotlib.ticker import LogLocator, NullFormatter

    axis.scatter(x, y)
    if min(x) <= 0 or max(x) <= 10 * min(x):
        return
    axis.set_xscale("log")
    # Ticks at 1 and 3 x each power of ten (1e-4, 3e-4, 1e-3, ...) while they fit.
    subs = (1.0, 3.0) if max(x) < 1000 * min(x) else (1.0,)
    axis.xaxis.set_major_locator(LogLocator(subs=subs))
    axis.xaxis.set_major_formatter("{x:g}")
    axis.xaxis.set_minor_formatter(NullFormatter())


def _scatter_categories(axis: "Axes", x: list[Any], y: list[float]) -> None:
    """A scatter with one x position per distinct value, in sorted order."""
    categories = sorted({str(value) for value in x})
    axis.scatter([categories.index(str(value)) for value in x], y)
    axis.set_xticks(range(len(categories)), categories)
    axis.set_xlim(-0.5, len(categories) - 0.5)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    return "" if value is None else str(value).replace("|", "\\|")  # a "|" would end the cell
