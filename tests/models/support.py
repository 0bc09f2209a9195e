"""Comparison helpers shared by the model tests."""

import torch


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute difference between two tensors of one shape."""
    return (a - b).abs().max().item()
