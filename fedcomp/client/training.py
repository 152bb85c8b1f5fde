"""Local training and evaluation (plain PyTorch), used by the ClientApp and the ServerApp."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


@dataclass(frozen=True)
class TrainConfig:
    """Local training hyper-parameters (run config keys in brackets).

    Attributes
    ----------
    local_epochs : int
        Passes over the local data per round [``local-epochs``], >= 1.
    batch_size : int
        Micro-batch size [``batch-size``], >= 1.
    accumulation_steps : int
        Micro-batches per optimizer step [``accumulation-steps``], >= 1; the effective batch
        is ``batch_size * accumulation_steps``.
    lr : float
        SGD learning rate [``lr``], > 0.
    momentum : float
        SGD momentum [``momentum``], in [0, 1). Local momentum 0.9 is what makes 20-50
        rounds enough on the default data.
    local_clip_norm : float
        Local gradient clipping [``local-clip-norm``]: before every optimizer step the
        gradient (of the whole model, after accumulation) is rescaled to L2 norm at most this
        value; 0 (default) turns it off. Deep Gradient Compression (Lin et al., ICLR 2018,
        Sec. 3.3) clips this way to keep sparse updates from exploding. Not a privacy
        mechanism (that is ``dp``).
    """

    local_epochs: int = 1
    batch_size: int = 32
    accumulation_steps: int = 1
    lr: float = 0.1
    momentum: float = 0.9
    local_clip_norm: float = 0.0


def pick_device(preference: str = "auto") -> torch.device:
    """``"cuda"`` if available and not disabled, else ``"cpu"``.

    Parameters
    ----------
    preference : {"auto", "cpu", "cuda"}
        Node config ``device``. "cuda" without a GPU raises.

    Raises
    ------
    ValueError
        Unknown preference, or "cuda" when CUDA is not available.
    """
    if preference not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {preference!r}")
    if preference == "cuda" and not torch.cuda.is_available():
        raise ValueError("device = 'cuda' but CUDA is not available on this node")
    if preference == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")


def train(
    model: nn.Module, data: Dataset, cfg: TrainConfig, device: torch.device, seed: int = 0
) -> tuple[float, int]:
    """Train ``model`` in place with SGD and gradient accumulation.

    The loss of each micro-batch is scaled by ``1 / accumulation_steps`` so that an
    optimizer step sees the mean gradient of ``batch_size * accumulation_steps`` samples;
    a trailing partial group still steps.

    Returns
    -------
    (mean_loss, num_examples)
        Mean cross-entropy per sample over all micro-batches, and ``len(data)``.
    """
    model.to(device).train()
    gen = torch.Generator().manual_seed(seed)
    loader = DataLoader(data, batch_size=cfg.batch_size, shuffle=True, generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    loss_fn = nn.CrossEntropyLoss()
    total, seen = 0.0, 0
    for _ in range(cfg.local_epochs):
        opt.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(loader, start=1):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = loss_fn(model(x), y)
            (loss / cfg.accumulation_steps).backward()
            total += float(loss.detach()) * len(y)
            seen += len(y)
            if i % cfg.accumulation_steps == 0 or i == len(loader):
                if cfg.local_clip_norm > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.local_clip_norm)
                opt.step()
                opt.zero_grad(set_to_none=True)
    return (total / seen if seen else 0.0), len(data)


@torch.no_grad()
def evaluate(model: nn.Module, data: Dataset, device: torch.device, batch_size: int = 512) -> tuple[float, float]:
    """Mean cross-entropy loss and accuracy (fraction in [0, 1]) of ``model`` on ``data``."""
    model.to(device).train(False)  # evaluation mode
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    total, correct, n = 0.0, 0, 0
    for x, y in DataLoader(data, batch_size=batch_size):
        x, y = x.to(device), y.to(device)
        out = model(x)
        total += float(loss_fn(out, y))
        correct += int((out.argmax(1) == y).sum())
        n += len(y)
    return (total / n, correct / n) if n else (0.0, 0.0)
