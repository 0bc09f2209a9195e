"""Refuse, before training, a monitored metric that no part of the run logs.

`optimized_metric` and each callback's `monitor` (best checkpoint, early stopping, Optuna pruning)
name a metric by its key. Lightning finds a mistyped one only when it first looks for it, after
a whole epoch, and a sweeper's never: its run just returns no value. Here the model and the
callbacks that log metrics declare them (`metric_keys()`), and a key is refused with the closest
declared one when it lies in a namespace they log (`val/...`) or is a near miss of one of theirs
(`val_acc`). Keys of other loggers (Lightning's `lr-AdamW`, the throughput callback's `perf/...`)
pass, as does everything for a model that declares nothing.
"""

import difflib
from collections.abc import Iterable, Iterator
from typing import Any

from omegaconf import DictConfig

from src.utils.contracts import MixedData
from src.utils.errors import ConfigError

# What a ModelCheckpoint can monitor without any metric logged (last.ckpt monitors `step`).
TRAINER_KEYS = frozenset({"step", "epoch"})
# How alike a key outside the declared namespaces must be to a declared key to be its typo.
NEAR_MISS = 0.85


def check_metric_keys(cfg: DictConfig, model: Any, datamodule: Any, callbacks: Iterable) -> None:
    """Raise a ConfigError naming the config key whose metric no part of this run logs."""
    declared = declared_metric_keys(model, datamodule, callbacks)
    if declared is None:
        return
    namespaces = {key.split("/")[0] for key in declared if "/" in key}
    for config_key, metric in monitored_metrics(cfg):
        if metric in declared or metric in TRAINER_KEYS:
            continue
        owned = "/" in metric and metric.split("/")[0] in namespaces
        cutoff = 0.0 if owned else NEAR_MISS
        close = difflib.get_close_matches(metric, sorted(declared), n=1, cutoff=cutoff)
        if close:
            raise ConfigError(
                f"{config_key}={metric!r} is not a metric this run logs: did you mean "
                f"{config_key}={close[0]}? It logs {', '.join(sorted(declared))}."
            )


def declared_metric_keys(model: Any, datamodule: Any, callbacks: Iterable) -> set[str] | None:
    """The keys the model and callbacks declare; None for a model that declares none."""
    if not hasattr(model, "metric_keys"):
        return None
    sources = datamodule.source_names if isinstance(datamodule, MixedData) else ()
    keys = set(model.metric_keys(sources) if sources else model.metric_keys())
    for callback in callbacks:
        if hasattr(callback, "metric_keys"):
            keys |= callback.metric_keys(model, datamodule)
    return keys


def monitored_metrics(cfg: DictConfig) -> Iterator[tuple[str, str]]:
    """(config key, metric) for `optimized_metric` and each callback's `monitor`."""
    optimized = cfg.get("optimized_metric")
    for metric in [optimized] if isinstance(optimized, str) else optimized or []:
        yield "optimized_metric", metric
    for name, node in (cfg.get("callbacks") or {}).items():
        if isinstance(node, DictConfig) and node.get("monitor"):
            yield f"callbacks.{name}.monitor", node.monitor
