"""Model, data and the train/test loops of the example app (plain PyTorch, no Flower)."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn


class Net(nn.Module):
    """A small CNN for the 8x8 sklearn digits, the size of Flower's quickstart models (53,002 parameters):
    two 3x3 convolutions (32 and 64 channels) with 2x2 max-pooling, then 256 -> 128 -> 10."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 2 * 2, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, 1, 8, 8)
        x = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def load_data(partition_id: int, num_partitions: int, seed: int = 0):
    """This partition's (train, test) tensors: an IID split of sklearn digits, 80/20 locally."""
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    part = np.array_split(order, num_partitions)[partition_id]
    x_t = torch.tensor(x[part] / 16.0, dtype=torch.float32)
    y_t = torch.tensor(y[part], dtype=torch.long)
    cut = int(0.8 * len(part))
    return (x_t[:cut], y_t[:cut]), (x_t[cut:], y_t[cut:])


def train(net: Net, data, epochs: int, lr: float, batch_size: int = 32, seed: int = 0) -> float:
    """Plain SGD for ``epochs`` epochs; returns the mean training loss of the last epoch."""
    x, y = data
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    loss_sum, n = 0.0, 0
    for _ in range(epochs):
        loss_sum, n = 0.0, 0
        for idx in torch.randperm(len(y), generator=gen).split(batch_size):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x[idx]), y[idx])
            loss.backward()
            opt.step()
            loss_sum += loss.item() * len(idx)
            n += len(idx)
    return loss_sum / max(n, 1)


@torch.no_grad()
def test(net: Net, data) -> tuple[float, float]:
    """(mean loss, accuracy) on ``data``."""
    x, y = data
    net.eval()
    out = net(x)
    return float(nn.functional.cross_entropy(out, y)), float((out.argmax(1) == y).float().mean())
