"""Pieces shared by the sparse codecs (stc, topk, randomk): k from density, validation."""

from __future__ import annotations

import numpy as np
import torch

from fedcomp.compression.base import SparseDecoding, check_range
from fedcomp.compression.chunked import float32_out
from fedcomp.compression.errors import PayloadError
from fedcomp.compression.positions import check_stream, encode_positions, iter_positions, positions_nbytes
from fedcomp.compression.wire import BodyReader, Header


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
    the chunks of `iter_positions` (``(first, int64
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


class ChunkedSparseDecoding(SparseDecoding):
    """Mixin of the sparse codecs: ``_decode_chunks(header, payload)`` returns ``(k, chunks)``,
    ``chunks`` an iterator of ``(positions, values)`` pieces (int64 strictly increasing, float32)
    in position order, validated as they are produced. The dense decode scatters them piece by
    piece (peak: the float32 output plus one piece, never the k int64 positions at once); the
    sparse decode fills ``(positions, values)`` arrays of exactly k entries.
    """

    @classmethod
    def _decode(cls, header: Header, payload: memoryview) -> np.ndarray:
        _, chunks = cls._decode_chunks(header, payload)
        out = np.zeros(header.numel, dtype=np.float32)
        for pos, vals in chunks:
            out[pos] = vals
        return out

    @classmethod
    def _decode_into(cls, header: Header, payload: memoryview, out: np.ndarray) -> None:
        _, chunks = cls._decode_chunks(header, payload)
        float32_out(out, cls.name).fill(0.0)
        for pos, vals in chunks:
            out[pos] = vals

    @classmethod
    def _decode_sparse(cls, header: Header, payload: memoryview) -> tuple[np.ndarray, np.ndarray]:
        k, chunks = cls._decode_chunks(header, payload)
        pos, vals, done = np.empty(k, dtype=np.int64), np.empty(k, dtype=np.float32), 0
        for p, v in chunks:
            if done + p.size > k:
                raise PayloadError(f"{cls.name}: more than the declared k = {k} entries")
            pos[done : done + p.size], vals[done : done + p.size] = p, v
            done += p.size
        if done != k:
            raise PayloadError(f"{cls.name}: {done} entries decoded, the header declares k = {k}")
        return pos, vals
