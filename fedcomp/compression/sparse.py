"""Pieces shared by the sparse codecs (stc, topk, randomk): k from density, validation."""

from __future__ import annotations

import numpy as np
import torch

from .base import check_range
from .errors import PayloadError
from .positions import check_stream, encode_positions, iter_positions, positions_nbytes
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


def read_positions(r: BodyReader, codec: str, k: int, n: int, b: int, unary_bits: int):
    """Check a sparse payload's position header, take its position block from ``r``, and return
    the chunks of :func:`~fedcomp.compression.positions.iter_positions` (``(first, int64
    positions)`` pairs; the stream is validated as they are produced).

    Raises
    ------
    PayloadError
        From the header fields alone (``k > n``, Rice parameter, a unary stream longer than
        ``k + ((n - k) >> b)`` bits), before any byte is read; or a truncated block.
    """
    try:
        check_stream(k, n, b, unary_bits)
    except PayloadError as exc:
        raise PayloadError(f"{codec}: {exc}") from None
    data = r.take(positions_nbytes(k, b, unary_bits), "positions")
    return iter_positions(data, k, n, b, unary_bits)


def scatter(n: int, chunks, values) -> np.ndarray:
    """Dense float32 ``(n,)`` array, zero except ``out[pos] = values(first, len(pos))`` per chunk.

    ``values(first, m)`` returns the m float values of kept entries ``first .. first + m - 1``;
    peak memory is the output plus one chunk.
    """
    out = np.zeros(n, dtype=np.float32)
    for first, pos in chunks:
        out[pos] = values(first, pos.size)
    return out
