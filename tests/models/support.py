"""Comparison helpers and a pretrained base shared by the model tests."""

from pathlib import Path

import torch
from hydra.utils import instantiate

from tests.helpers import FAST, TINY_LM, compose_config


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute difference between two tensors of one shape."""
    return (a - b).abs().max().item()


def save_tiny_base(folder: Path) -> Path:
    """TINY_LM's network with random weights (seed 0), saved as a transformers folder."""
    cfg = compose_config(folder / "compose", [*FAST, *TINY_LM])
    torch.manual_seed(0)
    instantiate(cfg.model).net.save_pretrained(folder / "model")
    return folder / "model"
