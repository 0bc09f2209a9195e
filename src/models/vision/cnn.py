"""CNN: two 3x3 convolutions (32 and 64 channels), max-pool, two linear layers."""

import torch
from torch import nn


class CNN(nn.Module):
    """The small convolutional classifier of PyTorch's MNIST example, for any image size.

    The flattened size feeding `fc1` is derived from `input_shape` (9216 for 28x28 inputs,
    256 for 8x8), so a different resolution or layer order never breaks the linear layer.
    """

    def __init__(
        self,
        input_shape: list[int],
        num_classes: int,
        hidden_size: int = 128,
        dropout: float = 0.25,
    ):
        super().__init__()
        channels = input_shape[0]
        self.conv1 = nn.Conv2d(channels, 32, kernel_size=3)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3)
        self.pool = nn.MaxPool2d(2)
        self.dropout = nn.Dropout(dropout)
        self.fc1 = nn.Linear(self._flattened_size(input_shape), hidden_size)
        self.fc2 = nn.Linear(hidden_size, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))  # [B, 32, H-2, W-2]
        x = torch.relu(self.conv2(x))  # [B, 64, H-4, W-4]
        return self.pool(x).flatten(1)  # [B, 64 * (H-4)//2 * (W-4)//2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout(self.features(x))
        x = self.dropout(torch.relu(self.fc1(x)))
        return self.fc2(x)  # [B, num_classes]

    @torch.no_grad()
    def _flattened_size(self, input_shape: list[int]) -> int:
        """Width of `features` for one image, measured by running it rather than by arithmetic."""
        if len(input_shape) != 3 or min(input_shape[1:]) < 6:
            raise ValueError(
                f"CNN needs input_shape [channels, height, width] of at least 6x6 pixels, "
                f"got {list(input_shape)}"
            )
        return self.features(torch.zeros(1, *input_shape)).shape[1]
