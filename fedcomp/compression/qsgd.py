"""``qsgd``: QSGD stochastic quantization.

Source: Alistarh, Grubic, Li, Tomioka, Vojnovic, "QSGD: Communication-Efficient SGD via
Gradient Quantization and Encoding", NeurIPS 2017.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from .base import Compressor, check_range, register
from .bits import nbytes_for_bits, pack_bits, pack_uint, unpack_bits, unpack_uint
from .errors import PayloadError
from .int8 import block_scale
from .stochastic import StochasticRounder
from .wire import BodyReader, Header, unpack_params

MAX_LEVELS = 2**16 - 1
MAX_BUCKET = 2**31 - 1


@register
class QSGDCompressor(Compressor):
    """QSGD with s levels and buckets: ``x_hat_i = ||x_B||_2 * sign(x_i) * l_i / s``.

    The tensor is cut into buckets B of ``bucket_size`` entries (the paper's bucketing,
    Sec. 3.1); each bucket sends its L2 norm in fp32 and
    ``l_i = floor(s * |x_i| / ||x_B||_2 + U[0,1))`` in ``[0, s]`` (stochastic rounding),
    so ``E[x_hat] = x`` (unbiased; the norm is rounded to fp32 before it is used, so the
    rounding does not bias). Variance: ``E||x_hat - x||^2 <= min(d/s^2, sqrt(d)/s) ||x||^2``
    per bucket of size d (Lemma 3.1).

    Size: fixed-width levels instead of the paper's Elias code, so exactly
    ``1 + ceil(log2(s + 1)) + 32 / bucket_size`` bits/parameter (sign bit, level, bucket
    norm) + 8 bytes of parameters + header; s = 15, bucket 512 gives 5.0625 bits.

    Parameters
    ----------
    levels : int
        s >= 1 (the paper's quantization levels). Default 15.
    bucket_size : int
        Entries per norm, >= 1. Default 512 (as in the paper's experiments).
    seed : int, optional
        Seed of the stochastic rounding; None draws from the OS.
    """

    name = "qsgd"
    codec_id = 7
    _PARAMS = "<II"  # levels, bucket size

    def __init__(self, levels: int = 15, bucket_size: int = 512, seed: int | None = None) -> None:
        check_range("levels", levels, 1, MAX_LEVELS, integer=True)
        check_range("bucket_size", bucket_size, 1, MAX_BUCKET, integer=True)
        self.levels = int(levels)
        self.bucket_size = int(bucket_size)
        self._rounder = StochasticRounder(seed)

    def config(self) -> dict:
        """``{"levels": s, "bucket_size": d}``."""
        return {"levels": self.levels, "bucket_size": self.bucket_size}

    @staticmethod
    def width(levels: int) -> int:
        """Bits per level field: ``ceil(log2(levels + 1))``."""
        return int(levels).bit_length()

    def _encode(self, flat: torch.Tensor) -> tuple[bytes, bytes]:
        s, n, bs = self.levels, flat.numel(), self.bucket_size
        bs = min(bs, max(n, 1))  # a block larger than the tensor is one block: pad no further than n
        nb = -(-n // bs)
        padded = torch.nn.functional.pad(flat, (0, nb * bs - n)).view(nb, bs)
        norms = torch.linalg.vector_norm(padded.double(), dim=1).to(torch.float32)
        if not bool(torch.isfinite(norms).all()):
            raise ValueError("qsgd: a bucket's L2 norm overflows float32")
        safe = torch.where(norms > 0, norms, torch.ones_like(norms))
        lv = self._rounder.round(padded.abs() * (s / safe[:, None])).clamp_(0, s)
        lv = lv.reshape(-1)[:n].to(torch.int32).cpu().numpy()
        signs = (flat < 0).cpu().numpy()
        body = norms.cpu().numpy().tobytes() + pack_bits(signs) + pack_uint(lv, self.width(s))
        return struct.pack(self._PARAMS, s, self.bucket_size), body

    @classmethod
    def _decode(cls, header: Header, payload: memoryview) -> np.ndarray:
        s, bs = unpack_params(cls._PARAMS, header.params, cls.name)
        if s < 1 or s > MAX_LEVELS:
            raise PayloadError(f"qsgd: levels {s} outside [1, {MAX_LEVELS}]")
        if bs < 1:
            raise PayloadError("qsgd: bucket size 0")
        n = header.numel
        nb = -(-n // bs)
        w = cls.width(s)
        r = BodyReader(payload, header.body_offset, cls.name)
        norms = np.frombuffer(r.take(4 * nb, "bucket norms"), dtype=np.float32)
        neg = unpack_bits(r.take(nbytes_for_bits(n), "sign bits"), n, "qsgd sign bits")
        lv = unpack_uint(r.take(nbytes_for_bits(n * w), "levels"), n, w, "qsgd levels")
        r.finish()
        if not np.isfinite(norms).all() or (norms < 0).any():
            raise PayloadError("qsgd: a bucket norm is negative or not finite")
        if n and int(lv.max()) > s:
            raise PayloadError(f"qsgd: a level exceeds s = {s}")
        mag = block_scale(lv, (norms / np.float32(s)).astype(np.float32), bs)
        np.negative(mag, out=mag, where=neg.astype(bool))
        return mag
