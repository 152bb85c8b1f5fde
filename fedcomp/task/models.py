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


class BasicBlock(nn.Module):
    """ResNet basic block (He et al., "Deep Residual Learning", CVPR 2016): two 3x3 convolutions
    with BatchNorm, identity shortcut, or a 1x1 convolution + BatchNorm when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))``."""
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class DigitsResNet(nn.Module):
    """A small ResNet with BatchNorm for 1x8x8 digits, 10 classes: a 3x3 stem (16 channels), three
    basic blocks (16 -> 32 -> 64 channels, the last two with stride 2: 8x8 -> 4x4 -> 2x2), global
    average pooling and a linear layer. 77,754 float32 parameters plus BatchNorm buffers (running
    mean/var, float32; ``num_batches_tracked``, int64 0-d): 56 tensors in the state_dict.

    Input ``(batch, 1, 8, 8)`` float32; output ``(batch, 10)`` logits. Not trainable with DP-SGD
    (Opacus refuses BatchNorm: per-sample gradients are undefined when samples share batch statistics).
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.layer1 = BasicBlock(16, 16)
        self.layer2 = BasicBlock(16, 32, stride=2)
        self.layer3 = BasicBlock(32, 64, stride=2)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits, shape ``(batch, num_classes)``."""
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(x.mean(dim=(2, 3)))


MODELS = {"cnn": DigitsCNN, "mlp": MLP, "resnet": DigitsResNet, "transformer": None}


def build_model(name: str = "cnn", image_shape: tuple[int, ...] = (1, 8, 8), num_classes: int = 10) -> nn.Module:
    """Build a model by name ("cnn" and "resnet" for 1x8x8 inputs, "mlp" for any image shape,
    "transformer" for byte sequences: `fedcomp.task.lm.build_transformer`, input shape ``(seq_len,)``).

    Raises
    ------
    ValueError
        Unknown name, or "cnn"/"resnet" with an image shape other than (1, 8, 8).
    """
    if name in ("cnn", "resnet"):
        if tuple(image_shape) != (1, 8, 8):
            raise ValueError(f"model '{name}' expects 1x8x8 images, got {tuple(image_shape)}; use model = 'mlp'")
        return DigitsCNN(num_classes) if name == "cnn" else DigitsResNet(num_classes)
    if name == "transformer":
        from fedcomp.task.lm import build_transformer, transformer_config
        from fedcomp.task.text_data import SEQ_LEN

        # the input shape of a byte sequence is (seq_len,); the image default means "the standard length"
        seq_len = int(image_shape[0]) if len(image_shape) == 1 else SEQ_LEN
        return build_transformer(transformer_config(seq_len=seq_len))
    if name == "mlp":
        n = 1
        for d in image_shape:
            n *= d
        return MLP(n, num_classes)
    raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
