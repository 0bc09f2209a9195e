"""SimpleNet: the classic one-hidden-layer MLP (784 -> 128 -> 10 on MNIST)."""

import math

import torch
from torch import nn


class SimpleNet(nn.Module):
    """Flatten the image, one hidden ReLU layer, then class logits."""

    def __init__(self, input_shape: list[int], num_classes: int, hidden_size: int = 128):
        super().__init__()
        self.fc1 = nn.Linear(math.prod(input_shape), hidden_size)
        self.fc2 = nn.Linear(hidden_size, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)  # [B, C*H*W]
        return self.fc2(torch.relu(self.fc1(x)))  # [B, num_classes]
