"""Synthetic token windows for the LoRA tests (the tiny base models are fixtures in conftest.py)."""

import torch
from torch.utils.data import TensorDataset

SEQ = 16  #: tokens per window


def windows(pid: int, n: int = 32) -> TensorDataset:
    """Client ``pid``'s text: a repeating pattern with a per-client stride (learnable, non-IID)."""
    g = torch.Generator().manual_seed(pid)
    start = torch.randint(0, 64, (n, 1), generator=g)
    seq = (start + torch.arange(SEQ + 1) * (1 + pid % 3)) % 64
    return TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())
