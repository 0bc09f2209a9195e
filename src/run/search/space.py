"""Hydra's sweep syntax as an Optuna search space, and a trial's values back as overrides.

The meaning is that of Hydra's Optuna sweeper (hydra-optuna-sweeper 1.3 and 1.4):

- `choice(a, b)`, and `shuffle(...)` of any sweep, is a categorical parameter.
- `range(start, stop[, step])` is an integer parameter from start to stop, both included (a float
  one when any of the three is a float); a grid search runs the values Hydra's basic sweeper
  runs, which stop is not one of.
- `interval(low, high)` is a float, `int(interval(low, high))` (or `tag(int, interval(...))`) an
  integer, both on a log scale under `tag(log, ...)`.

A tag other than `log` and `int` is refused rather than ignored: a misspelt `tag(lgo, ...)` would
silently sample on a linear scale. A value that is not a sweep is fixed (every trial gets it),
and `~key` deletes a key from every trial's config.
"""

import math
import warnings
from collections.abc import Iterable, Mapping
from decimal import Decimal
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
SearchSpace = tuple[dict[str, BaseDistribution], dict[str, str], list[str]]


def search_space(
    params: Mapping[str, Any] | None,
    arguments: Iterable[str],
    legacy: Mapping[str, Any] | None = None,
) -> SearchSpace:
    """Return the distributions to sample, the values fixed for every trial and the deletions.

    They come from the sweeper's `params` followed by the command line's overrides (for the same
    key, the command line wins), over the distributions of the 1.1-style `search_space`
    (`legacy`), which counts only without `params`.
    """
    distributions, fixed, deletions = create_params_from_overrides(
        [*param_lines(params), *arguments]
    )
    if legacy is None:
        return distributions, fixed, deletions
    if params is not None:
        warnings.warn(
            "Both hydra.sweeper.params and hydra.sweeper.search_space are set: the search "
            "uses params and ignores search_space.",
            UserWarning,
            stacklevel=2,
        )
        return distributions, fixed, deletions
    warnings.warn(
        "hydra.sweeper.search_space is deprecated: write the search space as "
        "hydra.sweeper.params (e.g. `x: interval(0, 1)`).",
        UserWarning,
        stacklevel=2,
    )
    old = {str(key): create_optuna_distribution_from_config(node) for key, node in legacy.items()}
    return {**{k: v for k, v in old.items() if k not in fixed}, **distributions}, fixed, deletions


def param_lines(params: Mapping[str, Any] | None) -> list[str]:
    """The sweeper's `params` as override lines, `key=value`."""
    return [f"{key}={value}" for key, value in (params or {}).items()]


def create_params_from_overrides(arguments: Iterable[str]) -> SearchSpace:
    """Sort overrides into distributions, fixed values (as written) and deletions (`~key`)."""
    distributions: dict[str, BaseDistribution] = {}
    fixed: dict[str, str] = {}
    deletions: list[str] = []
    for key, override in last_by_key(arguments).items():
        if override.is_delete():
            assert override.input_line is not None  # the parser keeps each override's text
            deletions.append(override.input_line)
        elif override.is_sweep_override():
            distribution = create_optuna_distribution_from_override(override)
            assert isinstance(distribution, BaseDistribution)  # a sweep's is never its text
            distributions[key] = distribution
        else:
            fixed[key] = override.get_value_element_as_str()
    return distributions, fixed, deletions


def last_by_key(arguments: Iterable[str]) -> dict[str, Override]:
    """The overrides parsed, the last one for each key."""
    parsed = OverridesParser.create().parse_overrides(list(arguments))
    return {override.get_key_element(): override for override in parsed}


def create_optuna_distribution_from_override(override: Override) -> BaseDistribution | str:
    """The Optuna distribution of a sweep (see the module docstring); a fixed value as written."""
    if not override.is_sweep_override():
        return override.get_value_element_as_str()
    sweep = override.value()
    where = f"{override.input_line!r}"
    if not isinstance(sweep, Sweep):
        raise ConfigError(f"{where}: Optuna cannot sample a glob(); list the options in choice().")
    unknown = sweep.tags - TAGS
    if unknown:
        raise ConfigError(
            f"{where}: Optuna understands the tags {sorted(TAGS)}; remove {sorted(unknown)}."
        )
    log = "log" in sweep.tags
    if isinstance(sweep, ChoiceSweep) or (isinstance(sweep, RangeSweep) and sweep.shuffle):
        return CategoricalDistribution(choices(listed_values(sweep), where))
    if isinstance(sweep, RangeSweep):
        return range_distribution(sweep, log, where)
    assert isinstance(sweep, IntervalSweep)
    low, high = sweep.start, sweep.end
    assert low is not None  # interval(low, high) sets both bounds
    assert high is not None
    check_bounds(low, high, log, where)
    if isinstance(low, int) and isinstance(high, int):  # int(interval(...))
        return IntDistribution(low, high, log=log)
    if "int" in sweep.tags:
        if not (low.is_integer() and high.is_integer()):
            raise ConfigError(f"{where}: tag(int, ...) needs whole bounds.")
        return IntDistribution(int(low), int(high), log=log)
    return FloatDistribution(low, high, log=log)


def create_optuna_distribution_from_config(config: Mapping[str, Any]) -> BaseDistribution:
    """The distribution of one entry of the 1.1-style `search_space`.

    `{type: int | float | categorical, low, high, step, log, choices}`.
    """
    kind, low, high = config.get("type"), config.get("low"), config.get("high")
    step, log = config.get("step"), bool(config.get("log", False))
    if kind == "categorical":
        return CategoricalDistribution(list(config.get("choices") or []))
    if kind not in ("int", "float") or low is None or high is None:
        raise ConfigError(
            f"hydra.sweeper.search_space entry {dict(config)} needs type: int, float or "
            f"categorical, with low and high (or choices)."
        )
    if kind == "int":
        return IntDistribution(int(low), int(high), log=log, step=1 if log else int(step or 1))
    return FloatDistribution(low, high, log=log, step=None if log else step)


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
    """Turn range(start, stop, step) into the grid start, start + step, ... up to stop."""
    start, stop, step = sweep.start, sweep.stop, sweep.step
    assert start is not None  # range() always sets start and stop
    assert stop is not None
    if step <= 0 or stop < start:
        raise ConfigError(f"{where}: the range holds no value; it needs start <= stop, step > 0.")
    if log and step != 1:
        raise ConfigError(f"{where}: a log-scaled range cannot have a step; drop the step.")
    check_bounds(start, stop, log, where)
    # Decimal: the last value of range(0.1, 0.5, 0.1) is 0.5, not 0.5000000000000001.
    steps = math.floor(round((stop - start) / step, 9))
    last = Decimal(str(start)) + steps * Decimal(str(step))
    if isinstance(start, int) and isinstance(stop, int) and isinstance(step, int):
        return IntDistribution(start, int(last), log=log, step=step)
    return FloatDistribution(float(start), float(last), log=log, step=None if log else step)


def grid_space(
    distributions: Mapping[str, BaseDistribution], arguments: Iterable[str]
) -> dict[str, list[Any]]:
    """The values a grid search runs for each parameter of `distributions`.

    Those Hydra's basic sweeper runs for a choice() or range() of `arguments` (so without the
    range's stop), every value of any other stepped distribution (an integer interval); a float
    interval has no grid and is refused.
    """
    overrides = last_by_key(arguments)
    grid: dict[str, list[Any]] = {}
    for key, distribution in distributions.items():
        sweep = overrides[key].value() if key in overrides else None
        if isinstance(sweep, ChoiceSweep | RangeSweep):
            grid[key] = listed_values(sweep)
        elif isinstance(distribution, CategoricalDistribution):
            grid[key] = list(distribution.choices)
        elif isinstance(distribution, IntDistribution | FloatDistribution) and distribution.step:
            count = round((distribution.high - distribution.low) / distribution.step)
            grid[key] = [distribution.low + index * distribution.step for index in range(count + 1)]
        else:
            raise ConfigError(
                f"{key}: the grid sampler runs listed values, not a float interval; use "
                f"choice(...) or range(start, stop, step)."
            )
    return grid


def listed_values(sweep: ChoiceSweep | RangeSweep) -> list[Any]:
    """The values Hydra's basic sweeper runs for a choice() or range(), in their order.

    Unshuffled: the order of a categorical's choices is part of what a seed reproduces.
    """
    return list(sweep.list) if isinstance(sweep, ChoiceSweep) else list(sweep.range())


def trial_overrides(
    params: Mapping[str, Any], fixed: Mapping[str, str], deletions: Iterable[str]
) -> list[str]:
    """A trial's overrides: its values (strings escaped as Hydra needs), then the fixed ones.

    The deletions come last.
    """
    sampled = [f"{key}={Transformer.str(value)}" for key, value in params.items()]
    return [*sampled, *(f"{key}={value}" for key, value in fixed.items()), *deletions]
