"""Models. The default is a small CNN for 8x8 handwritten digits (38,282 parameters)."""

from __future__ import annotations

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """CNN for 1x8x8 digits, 10 classes: two 3x3 convolutions (16, 32 channels), 2x2 max
    pool, a 64-unit hidden layer. 38,282 float32 parameters (153 KB dense).

    Input ``(batch, 1, 8, 8)`` float32 in [0, 1]; output ``(batch, 10)`` logits.
    No BatchNorm and no in-place activations, so Opacus accepts it unchanged.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits, shape ``(batch, num_classes)``."""
        x = torch.relu(self.conv1(x))
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        x = torch.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


class MLP(nn.Module):
    """Two-layer perceptron for flattened images: ``in_features -> hidden -> num_classes``.

    Used for hub datasets whose images are not 8x8 (e.g. 28x28 MNIST: 784 -> 128 -> 10).
    """

    def __init__(self, in_features: int, num_classes: int = 10, hidden: int = 128) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits, shape ``(batch, num_classes)``."""
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


MODELS = {"cnn": DigitsCNN, "mlp": MLP}


def build_model(name: str = "cnn", image_shape: tuple[int, ...] = (1, 8, 8), num_classes: int = 10) -> nn.Module:
    """Build a model by name ("cnn" for 1x8x8 inputs, "mlp" for any image shape).

    Raises
    ------
    ValueError
        Unknown name, or "cnn" with an image shape other than (1, 8, 8).
    """
    if name == "cnn":
        if tuple(image_shape) != (1, 8, 8):
            raise ValueError(f"model 'cnn' expects 1x8x8 images, got {tuple(image_shape)}; use model = 'mlp'")
        return DigitsCNN(num_classes)
    if name == "mlp":
        n = 1
        for d in image_shape:
            n *= d
        return MLP(n, num_classes)
    raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
