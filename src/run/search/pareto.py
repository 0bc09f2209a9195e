"""The Pareto front of a sweep of several objectives, and its plot."""

import itertools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def pareto_front(points: dict[str, list[float]], maximize: list[bool]) -> list[str]:
    """The keys of the points that no other point dominates, in the order of `points`.

    A point dominates another when it is at least as good on every objective and better on one;
    `maximize` says, for each objective, whether higher is better.
    """
    costs = {
        key: [-value if up else value for value, up in zip(values, maximize, strict=True)]
        for key, values in points.items()
    }
    return [
        key
        for key, cost in costs.items()
        if not any(dominates(other, cost) for other in costs.values())
    ]


def dominates(cost: list[float], other: list[float]) -> bool:
    """Whether `cost` is no higher than `other` on every objective and lower on one."""
    pairs = list(zip(cost, other, strict=True))
    return all(a <= b for a, b in pairs) and any(a < b for a, b in pairs)


def plot_pareto_front(
    points: dict[str, list[float]], front: list[str], names: list[str]
) -> "Figure":
    """Plot each pair of objectives, one subplot each: every point, the front's named by key.

    With two objectives the front is drawn as the line that joins its points.
    """
    # matplotlib: imported only when a sweep has something to plot.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    pairs = list(itertools.combinations(range(len(names)), 2))
    figure = Figure(figsize=(4.5 * len(pairs), 4))
    FigureCanvasAgg(figure)  # render with Agg, without pyplot's global state
    others = [values for key, values in points.items() if key not in front]
    for index, (x, y) in enumerate(pairs):
        axis = figure.add_subplot(1, len(pairs), index + 1)
        axis.scatter([p[x] for p in others], [p[y] for p in others], color="0.6", label="others")
        best = sorted(front, key=lambda key: (points[key][x], points[key][y]))
        style = "o-" if len(names) == 2 else "o"
        xs, ys = [points[key][x] for key in best], [points[key][y] for key in best]
        axis.plot(xs, ys, style, color="C3", label="Pareto front")
        for key, at_x, at_y in zip(best, xs, ys, strict=True):
            axis.annotate(key, (at_x, at_y), textcoords="offset points", xytext=(4, 4))
        axis.set(xlabel=names[x], ylabel=names[y])
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    return figure
