"""Pieces shared by the sparse codecs (stc, topk, randomk): k from density, validation."""

from __future__ import annotations

import numpy as np
import torch

from .base import check_range
from .errors import PayloadError
from .positions import MAX_RICE_PARAMETER, decode_positions, encode_positions, positions_nbytes
from .wire import BodyReader


def k_for(density: float, n: int) -> int:
    """Number of kept entries: ``clamp(round(density * n), 1, n)`` (0 for an empty tensor)."""
    if n == 0:
        return 0
    return int(min(max(round(density * n), 1), n))


def check_density(density: float) -> float:
    """Validate ``density`` (fraction of entries kept) in (0, 1]; return it as float."""
    check_range("density", density, 0.0, 1.0, lo_open=True)
    return float(density)


def positions_to_bytes(idx: torch.Tensor, n: int) -> tuple[int, int, bytes]:
    """Rice-code a sorted int64 index tensor (any device). Returns (b, unary_bits, bytes)."""
    return encode_positions(idx.cpu().numpy(), n)


def read_positions(r: BodyReader, codec: str, k: int, n: int, b: int, unary_bits: int) -> np.ndarray:
    """Read and validate the position block of a sparse payload (int64, shape (k,))."""
    if k > n:
        raise PayloadError(f"{codec}: k = {k} exceeds the tensor size {n}")
    if b > MAX_RICE_PARAMETER:
        raise PayloadError(f"{codec}: Rice parameter {b} exceeds {MAX_RICE_PARAMETER}")
    data = r.take(positions_nbytes(k, b, unary_bits), "positions")
    return decode_positions(data, k, n, b, unary_bits)
