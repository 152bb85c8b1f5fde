"""``qsgd``: QSGD stochastic quantization, with uniform or exponential (NUQSGD) levels.

Sources: Alistarh, Grubic, Li, Tomioka, Vojnovic, "QSGD: Communication-Efficient SGD via
Gradient Quantization and Encoding", NeurIPS 2017; Ramezani-Kebrya, Faghri, Markov, Aksenov,
Alistarh, Roy, "NUQSGD: Provably Communication-efficient Data-parallel SGD via Nonuniform
Quantization", JMLR 2021 (exponentially spaced levels).
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from fedcomp.compression.base import Compressor, check_range, register
from fedcomp.compression.bits import nbytes_for_bits, pack_bits_on_device, pack_uint_into, unpack_bits, unpack_uint
from fedcomp.compression.errors import PayloadError
from fedcomp.compression.int8 import block_scale
from fedcomp.compression.options import Option
from fedcomp.compression.stochastic import StochasticRounder
from fedcomp.compression.wire import BodyReader, Header, unpack_params

MAX_LEVELS = 2**16 - 1
#: Exponential spacing: the smallest non-zero level 2**(1-s) stays a normal float32.
MAX_EXPONENTIAL_LEVELS = 126
MAX_BUCKET = 2**31 - 1
SPACINGS = ("uniform", "exponential")
#: Entries quantized per step of :meth:`QSGDCompressor._encode` (whole buckets): bounds its
#: temporaries, so a dense round of an 11M-parameter model does not hold several copies of it.
ENCODE_CHUNK = 1 << 16


def _buckets(flat: torch.Tensor, b0: int, b1: int, bs: int) -> torch.Tensor:
    """Buckets ``b0 .. b1 - 1`` of ``flat`` as a ``(b1 - b0, bs)`` copy, the last one zero-padded."""
    part = flat[b0 * bs: min(b1 * bs, flat.numel())]
    return torch.nn.functional.pad(part, (0, (b1 - b0) * bs - part.numel())).view(b1 - b0, bs)


def exponential_position(r: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower level index and rounding probability of ``r`` in [0, 1] on the levels
    ``0, 2**(1-s), ..., 1/2, 1``.

    Level j (j = 1..s) is ``2**(j-s)``, level 0 is 0. Returns ``(j, p)`` with
    ``l_j <= r < l_{j+1}`` and ``p = (r - l_j) / (l_{j+1} - l_j)``: rounding up with
    probability p makes the expected level value r (unbiased). Both are exact, read from the
    float32 bits: ``r = (1 + f) * 2**e`` gives ``j = e + s`` and ``p = f`` above the first
    non-zero level, and ``p = r * 2**(s-1)`` below it.

    Parameters
    ----------
    r : torch.Tensor
        float32, entries in [0, 1] (``|x_i| / ||x_B||``).
    s : int
        Number of non-zero levels, 1..126 (so every level is a normal float32).

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        int32 j in [0, s] and float32 p in [0, 1), both of r's shape.
    """
    bits = r.contiguous().view(torch.int32)
    e = (bits >> 23) - 127  # unbiased exponent; -127 for 0 and subnormals (below every level)
    upper = e >= 1 - s
    frac = (bits & 0x7FFFFF).to(torch.float32) * 2.0**-23
    j = torch.where(upper, e + s, torch.zeros((), dtype=torch.int32, device=r.device))
    p = torch.where(upper, frac, r * float(2.0 ** (s - 1)))
    return j, p


def exponential_levels(s: int) -> np.ndarray:
    """The level values ``[0, 2**(1-s), ..., 1/2, 1]`` as float32, shape ``(s + 1,)``."""
    out = np.ldexp(np.ones(s + 1, dtype=np.float32), np.arange(-s, 1))
    out[0] = 0.0
    return out


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
    norm) + 8 bytes of parameters (9 with exponential spacing) + header; s = 15, bucket 512
    gives 5.0625 bits.

    ``spacing="exponential"`` is NUQSGD: the s non-zero levels are ``2**(j-s)``, j = 1..s
    (``0, 2**(1-s), ..., 1/4, 1/2, 1``), denser near 0 where most normalised entries of a
    bucket lie; stochastic rounding between the two adjacent levels keeps it unbiased
    (see :func:`exponential_position`); same bits per level as uniform spacing.

    Parameters
    ----------
    levels : int
        s >= 1 (the paper's quantization levels). Default 15.
    bucket_size : int
        Entries per norm, >= 1. Default 512 (as in the paper's experiments).
    spacing : {"uniform", "exponential"}
        Level placement: QSGD's ``l/s`` or NUQSGD's ``2**(j-s)`` (levels <= 126). Default
        "uniform".
    seed : int, optional
        Seed of the stochastic rounding; None draws from the OS.
    """

    name = "qsgd"
    codec_id = 7
    options = (Option("levels", int, 15, "quantization levels s >= 1", lo=1, hi=MAX_LEVELS, arg="levels"),
               Option("spacing", str, "uniform", 'level placement: "uniform" (QSGD) or "exponential" (NUQSGD)', choices=SPACINGS, arg="spacing"))
    seeded = True
    _PARAMS = "<II"  # levels, bucket size (uniform spacing)
    _PARAMS_SPACED = "<IIB"  # levels, bucket size, spacing code 1 (exponential)

    def __init__(self, levels: int = 15, bucket_size: int = 512, seed: int | None = None,
                 spacing: str = "uniform") -> None:
        if spacing not in SPACINGS:
            raise ValueError(f"spacing must be one of {list(SPACINGS)}, got {spacing!r}")
        top = MAX_EXPONENTIAL_LEVELS if spacing == "exponential" else MAX_LEVELS
        check_range("levels", levels, 1, top, integer=True)
        check_range("bucket_size", bucket_size, 1, MAX_BUCKET, integer=True)
        self.levels = int(levels)
        self.bucket_size = int(bucket_size)
        self.spacing = spacing
        self._rounder = StochasticRounder(seed)

    @classmethod
    def check_options(cls, values) -> None:
        """NUQSGD's exponential spacing takes at most :data:`MAX_EXPONENTIAL_LEVELS` levels.

        Raises
        ------
        ValueError
            ``'levels' must be in [1, 126] with spacing = 'exponential', got 200``.
        """
        if values["spacing"] == "exponential" and values["levels"] > MAX_EXPONENTIAL_LEVELS:
            raise ValueError(f"'levels' must be in [1, {MAX_EXPONENTIAL_LEVELS}] with spacing = 'exponential', "
                             f"got {values['levels']}")

    def config(self) -> dict:
        """``{"levels": s, "bucket_size": d}``, plus ``"spacing"`` when it is exponential."""
        out: dict = {"levels": self.levels, "bucket_size": self.bucket_size}
        if self.spacing != "uniform":
            out["spacing"] = self.spacing
        return out

    @staticmethod
    def width(levels: int) -> int:
        """Bits per level field: ``ceil(log2(levels + 1))``."""
        return int(levels).bit_length()

    def _encode(self, flat: torch.Tensor) -> tuple[bytes, bytes]:
        s, n, bs = self.levels, flat.numel(), self.bucket_size
        bs = min(bs, max(n, 1))  # a block larger than the tensor is one block: pad no further than n
        nb = -(-n // bs)
        rows = max(8, ENCODE_CHUNK // bs // 8 * 8)  # buckets per block: a multiple of 8 values each
        blocks = [(b, min(b + rows, nb)) for b in range(0, nb, rows)]
        norms = torch.empty(nb, dtype=torch.float32, device=flat.device)
        for b0, b1 in blocks:
            norms[b0:b1] = torch.linalg.vector_norm(_buckets(flat, b0, b1, bs).double(), dim=1).to(torch.float32)
        if not bool(torch.isfinite(norms).all()):
            raise ValueError("qsgd: a bucket's L2 norm overflows float32")
        safe = torch.where(norms > 0, norms, torch.ones_like(norms))
        exponential = self.spacing == "exponential"
        params = struct.pack(self._PARAMS_SPACED, s, self.bucket_size, 1) if exponential \
            else struct.pack(self._PARAMS, s, self.bucket_size)
        u = self._rounder.uniform((nb, bs), flat.device)  # one draw per entry, as rounding the whole would
        width = self.width(s)
        levels = np.empty(nbytes_for_bits(n * width), dtype=np.uint8)
        for b0, b1 in blocks:  # bounded temporaries: one block of buckets at a time
            block, sb = _buckets(flat, b0, b1, bs).abs(), safe[b0:b1, None]
            if exponential:
                j, p = exponential_position((block / sb).clamp_(max=1.0), s)
                lv = (torch.floor(p + u[b0:b1]) + j).clamp_(0, s)
            else:
                lv = torch.floor(block * (s / sb) + u[b0:b1]).clamp_(0, s)
            lv = lv.reshape(-1)[: min(b1 * bs, n) - b0 * bs].to(torch.int32).cpu().numpy()
            pack_uint_into(levels, b0 * bs, lv, width)
        del u
        body = b"".join((norms.cpu().numpy().tobytes(), pack_bits_on_device(flat < 0), levels.tobytes()))
        return params, body

    @classmethod
    def _decode(cls, header: Header, payload: memoryview) -> np.ndarray:
        exponential = len(header.params) == struct.calcsize(cls._PARAMS_SPACED)
        if exponential:
            s, bs, code = unpack_params(cls._PARAMS_SPACED, header.params, cls.name)
            if code != 1:
                raise PayloadError(f"qsgd: unknown spacing code {code}")
        else:
            s, bs = unpack_params(cls._PARAMS, header.params, cls.name)
        top = MAX_EXPONENTIAL_LEVELS if exponential else MAX_LEVELS
        if s < 1 or s > top:
            raise PayloadError(f"qsgd: levels {s} outside [1, {top}]")
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
        if exponential:
            mag = block_scale(exponential_levels(s)[lv], norms, bs)
        else:
            mag = block_scale(lv, (norms / np.float32(s)).astype(np.float32), bs)
        np.negative(mag, out=mag, where=neg.astype(bool))
        return mag
