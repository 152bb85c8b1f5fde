"""Local training and evaluation (plain PyTorch), used by the ClientApp and the ServerApp."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fedcomp.task.objective import loss_and_hits

OPTIMIZERS = ("sgd", "adamw")
PRECISIONS = ("fp32", "bf16")


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
        SGD momentum [``momentum``], in [0, 1).
    local_clip_norm : float
        Local gradient clipping [``local-clip-norm``]: before every optimizer step the
        gradient (of the whole model, after accumulation) is rescaled to L2 norm at most this
        value; 0 (default) turns it off. Deep Gradient Compression (Lin et al., ICLR 2018,
        Sec. 3.3) clips this way to keep sparse updates from exploding. Not a privacy
        mechanism (that is ``dp``).
    optimizer : str
        [``optimizer``] "sgd" (``lr``, ``momentum``) or "adamw" (Loshchilov & Hutter, ICLR 2019:
        ``lr``, ``adam-beta1``, ``adam-beta2``). The optimizer and its state are new every round.
    beta1, beta2 : float
        AdamW's moment decay rates [``adam-beta1``, ``adam-beta2``], in [0, 1).
    weight_decay : float
        Decoupled weight decay (AdamW) or L2 penalty (SGD) [``weight-decay``], >= 0.
    precision : str
        [``precision``] "fp32", or "bf16": forward and loss under ``torch.autocast`` in bfloat16
        (CPU and CUDA); weights, gradients and optimizer state stay fp32, so the update the client
        sends is fp32.
    """

    local_epochs: int = 1
    batch_size: int = 32
    accumulation_steps: int = 1
    lr: float = 0.1
    momentum: float = 0.9
    local_clip_norm: float = 0.0
    optimizer: str = "sgd"
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    precision: str = "fp32"


def make_optimizer(params, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The local optimizer named by ``cfg.optimizer`` over ``params``.

    Raises
    ------
    ValueError
        An unknown optimizer name.
    """
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {cfg.optimizer!r}")


def autocast(device: torch.device, precision: str):
    """``torch.autocast`` in bfloat16 for ``precision = "bf16"``, a no-op context for "fp32".

    Raises
    ------
    ValueError
        An unknown precision.
    """
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    if precision == "fp32":
        return contextlib.nullcontext()
    raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


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
    """Train ``model`` in place with SGD or AdamW and gradient accumulation.

    Classifiers (labels ``(batch,)``) and causal language models (targets ``(batch, seq)``,
    see `fedcomp.task.objective`) alike. The loss of each micro-batch is scaled by
    ``1 / accumulation_steps`` so that an optimizer step sees the mean gradient of
    ``batch_size * accumulation_steps`` samples; a trailing partial group still steps.

    Returns
    -------
    (mean_loss, num_examples)
        Mean cross-entropy per predicted item (sample or character) over all micro-batches, and
        ``len(data)``.
    """
    model.to(device).train()
    gen = torch.Generator().manual_seed(seed)
    loader = DataLoader(data, batch_size=cfg.batch_size, shuffle=True, generator=gen)
    opt = make_optimizer(model.parameters(), cfg)
    total, seen = 0.0, 0
    for _ in range(cfg.local_epochs):
        opt.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(loader, start=1):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast(device, cfg.precision):
                loss, _, count = loss_and_hits(model(x), y)
            (loss / cfg.accumulation_steps).backward()
            total += float(loss.detach()) * count
            seen += count
            if i % cfg.accumulation_steps == 0 or i == len(loader):
                if cfg.local_clip_norm > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.local_clip_norm)
                opt.step()
                opt.zero_grad(set_to_none=True)
    return (total / seen if seen else 0.0), len(data)


@torch.no_grad()
def evaluate(model: nn.Module, data: Dataset, device: torch.device, batch_size: int = 512) -> tuple[float, float]:
    """Mean cross-entropy loss and accuracy (fraction in [0, 1]) of ``model`` on ``data``, per
    predicted item: per sample for a classifier, per character for a language model.

    Raises
    ------
    ValueError
        ``data`` has no item (a loss of 0.0 on nothing would read as a perfect model).
    """
    if len(data) == 0:
        raise ValueError("evaluate: the evaluation set is empty (no samples); a loss on nothing is undefined")
    model.to(device).train(False)  # evaluation mode
    total, correct, n = 0.0, 0, 0
    for x, y in DataLoader(data, batch_size=batch_size):
        loss, hits, count = loss_and_hits(model(x.to(device)), y.to(device), reduction="sum")
        total += float(loss)
        correct += hits
        n += count
    return (total / n, correct / n) if n else (0.0, 0.0)
