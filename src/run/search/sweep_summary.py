"""Tabulate a multirun when it ends, as a Hydra callback.

Overrides -> metrics and the best job (the Pareto front's jobs for several metrics); for an
Optuna search, each trial's state and each parameter's importance.
"""

import csv
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from src.run.outputs import METRICS_FILE
from src.run.search.pareto import pareto_front, plot_pareto_front
from src.utils.error_boundary import read_job_error
from src.utils.errors import ConfigError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

log = logging.getLogger(__name__)


class SweepSummary(Callback):
    """Write `summary.csv`, `summary.md` and `summary.png` in the sweep directory.

    The CSV holds every metric of every job. With one metric the plot shows it against each
    swept parameter and the best job is marked; with several (`metric` a list) the plot shows
    the Pareto front, whose jobs are marked. Each job is read back from its own `metrics.json`
    and `.hydra/overrides.yaml`, so the summary works the same for any sweeper and launcher.

    - `mode`: "max" or "min" ("maximize"/"minimize" too, so that it can follow Optuna's
      sweeper), or a list of them, one per metric.
    - `storage` and `study_name` of an Optuna search, whose job numbers are its trial numbers:
      each job also gets its trial's state (a pruned trial is never the best; one still running,
      in another launch that shares the study and the sweep directory, has not failed), and the
      summary the importance of each parameter.
    """

    def __init__(
        self,
        metric: str | Sequence[str] | None = None,
        mode: str | Sequence[str] = "max",
        storage: str | None = None,
        study_name: str | None = None,
    ):
        self.metrics = [] if metric is None else [metric] if isinstance(metric, str) else [*metric]
        modes = [mode] if isinstance(mode, str) else [*mode]
        if len(modes) == 1:
            modes *= len(self.metrics)
        if self.metrics and len(modes) != len(self.metrics):
            raise ConfigError(
                f"hydra.callbacks.sweep_summary: the modes {modes} do not pair with the metrics "
                f"{self.metrics}; give one mode, or one per metric."
            )
        self.maximize = [not mode.startswith("min") for mode in modes]
        self.storage = storage
        self.study_name = study_name

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Write the summary; then, if any job failed, end the sweep with exit status 1."""
        sweep_dir = Path(config.hydra.sweep.dir)
        states: dict[int, str] | None = None
        importances: dict[str, dict[str, float]] = {}
        if self.storage and self.study_name:
            from src.run.search.results import load_study_report  # optuna: searches only

            # The trials' states before the jobs' folders: a trial another launch finishes in
            # between is then read as running, never as a job without its metrics.
            objectives = self.metrics or ["value"]
            states, importances = load_study_report(self.storage, self.study_name, objectives)
        rows, params = collect_jobs(sweep_dir)
        if not rows:
            log.warning("No job of the sweep in %s started.", sweep_dir)
            return
        if states is not None:
            for row in rows:
                row["state"] = states.get(int(row["job"])) if row["job"].isdigit() else None
                # RUNNING, or asked since: in another launch that shares the study.
                if row["state"] in ("RUNNING", None) and row["status"] != "ok":
                    row["status"] = "running"
        write_csv(rows, sweep_dir / "summary.csv")
        marked = self.marked_jobs(rows)
        headline = self.headline(marked)
        text = "# Sweep summary\n\n" + (f"{headline}\n\n" if headline else "")
        text += markdown_table(rows, self.metrics, marked)
        figure = self.plot(rows, params, list(marked))
        if figure is not None:
            figure.savefig(sweep_dir / "summary.png")
            text += f"\n![{self.plot_caption()}](summary.png)\n"
        text += importance_table(importances)
        (sweep_dir / "summary.md").write_text(text)
        log.info("Sweep summary: %s (%s)", sweep_dir / "summary.md", headline or "no metric")
        failed = [row["job"] for row in rows if row["status"] not in ("ok", "running")]
        if failed:
            raise SystemExit(
                f"Error: {len(failed)} of {len(rows)} jobs of the sweep failed (job "
                f"{', '.join(failed)}): their errors are in {sweep_dir / 'summary.md'}."
            )

    def best_job(self, rows: list[dict[str, Any]]) -> str | None:
        """The job with the best value of the one metric."""
        scored = self.scored(rows)
        if len(self.metrics) != 1 or not scored:
            return None
        pick = max if self.maximize[0] else min
        return pick(scored, key=lambda row: row[self.metrics[0]])["job"]

    def marked_jobs(self, rows: list[dict[str, Any]]) -> dict[str, str]:
        """The jobs the table marks: the best one, or those of the Pareto front."""
        if len(self.metrics) > 1:
            return dict.fromkeys(pareto_front(self.points(rows), self.maximize), "Pareto")
        best = self.best_job(rows)
        return {} if best is None else {best: "best"}

    def scored(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The jobs with a number for every metric, pruned and failed trials left out."""
        return [
            row
            for row in rows
            if all(_is_number(row.get(metric)) for metric in self.metrics)
            and row.get("state", "COMPLETE") == "COMPLETE"
        ]

    def points(self, rows: list[dict[str, Any]]) -> dict[str, list[float]]:
        """Each scored job's metrics: a point of the space of objectives."""
        return {row["job"]: [row[metric] for metric in self.metrics] for row in self.scored(rows)}

    def headline(self, marked: dict[str, str]) -> str:
        """The best job, or the jobs of the Pareto front, in a sentence ("" without a metric)."""
        jobs = ", ".join(marked) or None
        if len(self.metrics) > 1:
            goals = ", ".join(f"`{metric}` ({way})" for metric, way in self.directions())
            return f"Pareto front of {goals}: jobs {jobs}"
        return f"Best job by `{self.metrics[0]}`: {jobs}" if self.metrics else ""

    def directions(self) -> list[tuple[str, str]]:
        """Each metric with the way it improves, "max" or "min"."""
        ways = ["max" if up else "min" for up in self.maximize]
        return list(zip(self.metrics, ways, strict=True))

    def plot(self, rows: list[dict[str, Any]], params: list[str], front: list[str]) -> Any:
        """Plot the metric against each swept parameter, or the Pareto front.

        None when there is nothing to plot.
        """
        if len(self.metrics) > 1:
            points = self.points(rows)
            labels = [f"{metric} ({way})" for metric, way in self.directions()]
            return plot_pareto_front(points, front, labels) if points else None
        metric = self.metrics[0] if self.metrics else None
        if metric and params and any(_is_number(row.get(metric)) for row in rows):
            return plot_metric(rows, metric, params)
        return None

    def plot_caption(self) -> str:
        if len(self.metrics) > 1:
            return "the Pareto front of " + " and ".join(self.metrics)
        return f"{self.metrics[0]} against each swept parameter"


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


def markdown_table(rows: list[dict[str, Any]], metrics: list[str], marked: dict[str, str]) -> str:
    """The jobs as a Markdown table: overrides, the sweep's metrics first, then test metrics.

    Each job of `marked` gets its mark ("best", "Pareto") beside its number.
    """
    metric_columns = [*metrics]
    metric_columns += sorted(
        {key for row in rows for key in row if key.startswith("test/") and key not in metrics}
    )
    states = ["state"] if any("state" in row for row in rows) else []
    header = ["job", "overrides", *metric_columns, "wall_time_s", "status", *states]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [_cell(row.get(column)) for column in header]
        if row["job"] in marked:
            cells[0] += f" ({marked[row['job']]})"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def importance_table(importances: dict[str, dict[str, float]]) -> str:
    """Write Optuna's importance of each parameter as a Markdown section (empty without any).

    One column per objective. Optuna's default evaluator computes them over the complete
    trials; each column sums to 1.
    """
    if not importances:
        return ""
    objectives = list(importances)
    params = list(dict.fromkeys(name for values in importances.values() for name in values))
    lines = ["| parameter | " + " | ".join(objectives) + " |", "|---|" + "---|" * len(objectives)]
    for param in params:
        cells = [_cell(importances[objective].get(param)) for objective in objectives]
        lines.append(f"| {param} | " + " | ".join(cells) + " |")
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
