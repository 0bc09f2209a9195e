"""The split and loader options every datamodule shares, under one set of rules."""

from collections.abc import Sized

import torch
from torch.utils.data import Dataset, Subset, random_split

from src.utils.errors import ConfigError


def check_loader_options(batch_size: int, eval_batch_size: int | None = None) -> None:
    """Batch sizes are positive integers (`eval_batch_size` null: the training batch size)."""
    for key, value in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size)):
        if value is not None and value < 1:
            raise ConfigError(f"data.{key} must be a positive integer, got {value}")


def check_fractions(val_fraction: float, test_fraction: float = 0.0) -> None:
    """A validation share above 0, a test share of 0 or more, and both together below 1.

    A test share of 0 cuts no test split from this data; below 1 together, data is left for
    training.
    """
    if not (val_fraction > 0 and test_fraction >= 0 and val_fraction + test_fraction < 1):
        raise ConfigError(
            "data.val_fraction must be positive, data.test_fraction 0 or more, and together "
            f"below 1 so that data is left for training; got {val_fraction} and {test_fraction}"
        )


def split_off(dataset: Dataset, fraction: float, seed: int) -> tuple[Subset, Subset]:
    """(rest, part): `fraction` of `dataset` split off at random, the same way for the same seed.

    `part` is empty for a fraction of 0.
    """
    if not 0.0 <= fraction < 1.0:
        raise ConfigError(f"A split fraction must be in [0, 1), got {fraction}")
    assert isinstance(dataset, Sized)  # every dataset split here knows its length
    if fraction == 0:
        return Subset(dataset, range(len(dataset))), Subset(dataset, [])
    generator = torch.Generator().manual_seed(seed)
    rest, part = random_split(dataset, [1.0 - fraction, fraction], generator=generator)
    return rest, part
