"""The value a run returns to a sweeper: the metric `optimized_metric` names, or several."""

from collections.abc import Mapping
from typing import Any


def optimized_value(metrics: Mapping[str, Any], optimized_metric: Any) -> Any:
    """The metric `optimized_metric` names, or for a list of names the tuple of their metrics.

    None (or None in the tuple) for a metric the run did not log.
    """
    if optimized_metric is None:
        return None
    if isinstance(optimized_metric, str):
        return metrics.get(optimized_metric)
    return tuple(metrics.get(key) for key in optimized_metric)
