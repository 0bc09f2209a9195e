"""Hydra's sweep syntax as an Optuna search space, and a trial's values back as overrides.

`choice(a, b)` is a categorical parameter, `range(start, stop[, step])` an integer (or float)
parameter on a grid whose `stop` is excluded, as in Hydra's basic sweeper, and
`interval(low, high)` a float, sampled on a log scale under `tag(log, ...)` and as an integer
under `tag(int, ...)`. `shuffle(...)` and any tag but `log` and `int` have no meaning to Optuna
and are refused. A value that is not a sweep is fixed: every trial gets it.
"""

import math
from collections.abc import Iterable, Mapping
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import (
    ChoiceSweep,
    IntervalSweep,
    Override,
    RangeSweep,
    Sweep,
    Transformer,
)
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from src.utils.errors import ConfigError

TAGS = {"log", "int"}


def search_space(
    params: Mapping[str, Any] | None, arguments: Iterable[str]
) -> tuple[dict[str, BaseDistribution], list[str]]:
    """Return the distributions to sample and the fixed overrides that every trial gets.

    They come from the sweeper's `params` (key: sweep) followed by the command line's overrides:
    for the same key, the command line wins.
    """
    lines = [f"{key}={value}" for key, value in (params or {}).items()]
    by_key: dict[str, Override] = {}
    for override in OverridesParser.create().parse_overrides([*lines, *arguments]):
        by_key[override.get_key_element()] = override
    distributions: dict[str, BaseDistribution] = {}
    fixed: list[str] = []
    for key, override in by_key.items():
        if override.is_sweep_override():
            distributions[key] = distribution(override)
        else:
            assert override.input_line is not None  # the parser keeps each override's text
            fixed.append(override.input_line)
    return distributions, fixed


def distribution(override: Override) -> BaseDistribution:
    """The Optuna distribution of one sweep override (see the module docstring)."""
    sweep = override.value()
    assert isinstance(sweep, Sweep)  # the caller passes sweep overrides only
    where = f"{override.input_line!r}"
    unknown = sweep.tags - TAGS
    if unknown or getattr(sweep, "shuffle", False):
        raise ConfigError(
            f"{where}: Optuna understands the tags {sorted(TAGS)} and no shuffle(); "
            f"remove {sorted(unknown) or 'shuffle'}."
        )
    if isinstance(sweep, ChoiceSweep):
        return CategoricalDistribution(choices(sweep.list, where))
    if isinstance(sweep, RangeSweep):
        return range_distribution(sweep, "log" in sweep.tags, where)
    assert isinstance(sweep, IntervalSweep)
    assert sweep.start is not None  # interval(low, high) sets both bounds
    assert sweep.end is not None
    check_bounds(sweep.start, sweep.end, "log" in sweep.tags, where)
    if "int" in sweep.tags:
        if not (sweep.start.is_integer() and sweep.end.is_integer()):
            raise ConfigError(f"{where}: tag(int, ...) needs whole bounds.")
        return IntDistribution(int(sweep.start), int(sweep.end), log="log" in sweep.tags)
    return FloatDistribution(sweep.start, sweep.end, log="log" in sweep.tags)


def check_bounds(low: float, high: float, log: bool, where: str) -> None:
    """Refuse bounds Optuna cannot sample: low above high, or a log scale reaching 0."""
    if low > high:
        raise ConfigError(
            f"{where}: its low bound {low} is above its high bound {high}; swap them."
        )
    if log and low <= 0:
        raise ConfigError(
            f"{where}: a log-scaled range needs bounds above 0, and its low bound is {low}; start "
            f"it at a small positive value (e.g. 1e-6)."
        )


def choices(values: list[Any], where: str) -> list[Any]:
    """The values of a choice(), which Optuna stores as they are: numbers, strings, booleans."""
    for value in values:
        if not isinstance(value, str | int | float | bool | type(None)):
            raise ConfigError(
                f"{where}: Optuna chooses among numbers, strings and booleans only, not "
                f"{Transformer.str(value)}; make each option a config file and choose its name."
            )
    return values


def range_distribution(sweep: RangeSweep, log: bool, where: str) -> BaseDistribution:
    """Turn range(start, stop, step) into the grid start, start + step, ... below stop.

    As Hydra's basic sweeper runs it.
    """
    start, stop, step = sweep.start, sweep.stop, sweep.step
    assert start is not None  # range() always sets start and stop
    assert stop is not None
    # Rounded, so that float steps such as range(0.1, 0.5, 0.1) stop below 0.5 as in Hydra.
    count = math.ceil(round((stop - start) / step, 9)) if step > 0 else 0
    if count < 1:
        raise ConfigError(f"{where}: the range holds no value; it needs start < stop, step > 0.")
    if log and step != 1:
        raise ConfigError(f"{where}: a log-scaled range cannot have a step; drop the step.")
    check_bounds(start, stop, log, where)
    if isinstance(start, int) and isinstance(stop, int) and isinstance(step, int):
        return IntDistribution(start, start + (count - 1) * step, log=log, step=step)
    last = start + (count - 1) * step
    return FloatDistribution(start, last, log=log, step=None if log else step)


def trial_overrides(params: Mapping[str, Any]) -> list[str]:
    """A trial's values as Hydra overrides (`key=value`, strings escaped as Hydra needs)."""
    return [f"{key}={Transformer.str(value)}" for key, value in params.items()]
