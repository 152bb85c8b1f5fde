"""``qsgd``: QSGD stochastic quantization, with uniform or exponential (NUQSGD) levels.

Sources: Alistarh, Grubic, Li, Tomioka, Vojnovic, "QSGD: Communication-Efficient SGD via
Gradient Quantization and Encoding", NeurIPS 2017; Ramezani-Kebrya, Faghri, Markov, Aksenov,
Alistarh, Roy, "NUQSGD: Provably Communication-efficient Data-parallel SGD via Nonuniform
Quantization", JMLR 2021 (exponentially spaced levels).
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from fedcomp.compression.base import Compressor, check_range
from fedcomp.compression.bits import (
    UintStreamWriter,
    check_padding,
    check_uint_stream,
    nbytes_for_bits,
    pack_bits_array,
    pack_uint_array,
    uint_dtype,
    unpack_uint_range,
)
from fedcomp.compression.chunked import CHUNK, blocks, float32_out, on_cpu, padded_rows, padded_rows_np
from fedcomp.compression.errors import PayloadError
from fedcomp.compression.options import Option
from fedcomp.compression.stochastic import StochasticRounder
from fedcomp.compression.wire import BodyReader, Header, unpack_params

MAX_LEVELS = 2**16 - 1
#: Exponential spacing: the smallest non-zero level 2**(1-s) stays a normal float32.
MAX_EXPONENTIAL_LEVELS = 126
MAX_BUCKET = 2**31 - 1
SPACINGS = ("uniform", "exponential")


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


def exponential_position_np(r: np.ndarray, s: int) -> tuple[np.ndarray, np.ndarray]:
    """`exponential_position` in numpy, for the CPU path: the same exact values.

    Parameters
    ----------
    r : np.ndarray
        float32, 1-D, contiguous, entries in [0, 1].
    s : int
        Number of non-zero levels, 1..126.

    Returns
    -------
    (np.ndarray, np.ndarray)
        int32 j in [0, s] and float32 p in [0, 1), both of r's shape.
    """
    bits = r.view(np.int32)
    e = (bits >> 23) - np.int32(127)
    upper = e >= 1 - s
    frac = (bits & np.int32(0x7FFFFF)).astype(np.float32)
    frac *= np.float32(2.0**-23)
    j = np.where(upper, e + np.int32(s), np.int32(0))
    p = np.where(upper, frac, r * np.float32(2.0 ** (s - 1)))
    return j, p


def exponential_levels(s: int) -> np.ndarray:
    """The level values ``[0, 2**(1-s), ..., 1/2, 1]`` as float32, shape ``(s + 1,)``."""
    out = np.ldexp(np.ones(s + 1, dtype=np.float32), np.arange(-s, 1))
    out[0] = 0.0
    return out


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
    (see `exponential_position`); same bits per level as uniform spacing.

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
               Option("spacing", str, "uniform", 'level placement: "uniform" (QSGD) or "exponential" (NUQSGD)',
                      choices=SPACINGS, arg="spacing"))
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
        """NUQSGD's exponential spacing takes at most `MAX_EXPONENTIAL_LEVELS` levels.

        Raises
        ------
        ValueError
            ``'levels' must be in [1, 126] with spacing = 'exponential', got 200``.
        """
        if values["spacing"] == "exponential" and values["levels"] > MAX_EXPONENTIAL_LEVELS:
            raise ValueError(f"'levels' must be in [1, {MAX_EXPONENTIAL_LEVELS}] with spacing = 'exponential', "
                             f"got {values['levels']}")

    def variance_bound(self, levels: int | None = None) -> float:
        """Worst-case ``E||x_hat - x||^2 / ||x||^2`` over a bucket of ``bucket_size`` entries (at ``levels``, default
        this codec's).

        Each entry rounds between its two adjacent levels ``lo <= r <= hi`` (r = |x_i| / ||x_B||), with variance
        ``(hi - r)(r - lo)``. Uniform spacing (gap 1/s): at most ``min(1/(4 s^2), r/s)`` an entry, so
        ``min(d/(4 s^2), sqrt(d)/s)`` a bucket (Lemma 3.1's bound with the 1/4 of the rounding's variance).
        Exponential spacing: between two levels above the smallest (``hi = 2 lo``) the variance is at most
        ``r^2/8`` (its largest share of r^2, at ``r = 4/3 lo``); below it (``l0 = 2**(1-s)``) ``(l0 - r) r``, which
        is at most ``r^2/8 + 2 l0^2/9`` and at most ``l0 r``: ``1/8 + min(2 d l0^2/9, sqrt(d) l0)`` a bucket.
        """
        s, d = self.levels if levels is None else levels, self.bucket_size
        if self.spacing == "exponential":
            lowest = 2.0 ** (1 - s)
            return 0.125 + min(2 * d * lowest * lowest / 9, math.sqrt(d) * lowest)
        return min(d / (4 * s * s), math.sqrt(d) / s)

    def error_feedback_refusal(self) -> str:
        """Non-empty where `variance_bound` is >= 1: error feedback's residual would grow without bound (few
        levels for the bucket size); names the fewest levels that keep it below 1."""
        bound = self.variance_bound()
        if bound < 1.0:
            return ""
        top = MAX_EXPONENTIAL_LEVELS if self.spacing == "exponential" else MAX_LEVELS
        fewest = next((s for s in range(self.levels + 1, top + 1) if self.variance_bound(s) < 1.0), None)
        raise_to = (f"raise 'levels' to {fewest} or more" if fewest else "use fewer entries per bucket")
        return (f"qsgd with levels={self.levels}, bucket_size={self.bucket_size}, spacing={self.spacing!r} has a "
                f"worst-case variance E||C(x) - x||^2 of {bound:.2f} ||x||^2, and error feedback diverges unless it is "
                f"below 1: {raise_to}")

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

    def _encode(self, flat: torch.Tensor) -> tuple[bytes, bytes | tuple]:
        s, n, bs = self.levels, flat.numel(), self.bucket_size
        bs = min(bs, max(n, 1))  # a block larger than the tensor is one block: pad no further than n
        nb = -(-n // bs)
        # cache-sized chunks of whole buckets: first every norm (checked before any random draw),
        # then levels by stochastic rounding, signs and packing
        norms = torch.empty(nb, device=flat.device)
        for b0, b1, _, _ in blocks(n, bs, flat.device):
            norms[b0:b1] = torch.linalg.vector_norm(padded_rows(flat, b0, b1, bs).double(), dim=1)
        if not bool(torch.isfinite(norms).all()):
            raise ValueError("qsgd: a bucket's L2 norm overflows float32")
        # a norm below float32's smallest normal (a bucket of subnormal entries) has no finite reciprocal:
        # such a bucket is levelled against 1, i.e. sent as zeros (error feedback keeps it)
        safe = torch.where(norms >= torch.finfo(torch.float32).tiny, norms, torch.ones_like(norms))
        exponential = self.spacing == "exponential"
        params = struct.pack(self._PARAMS_SPACED, s, self.bucket_size, 1) if exponential else \
            struct.pack(self._PARAMS, s, self.bucket_size)
        if on_cpu(flat):
            signs, lv = self._levels_cpu(flat.numpy(), bs, safe.numpy(), exponential)
            return params, (norms.numpy(), signs, lv)
        rows = padded_rows(flat, 0, nb, bs).abs()  # one chunk: every bucket at once
        if exponential:
            j, p = exponential_position(rows.div_(safe[:, None]).clamp_(max=1.0), s)
            level = self._rounder.round_(p).add_(j).clamp_(0, s)
        else:
            level = self._rounder.round_(rows.mul_(s / safe[:, None])).clamp_(0, s)
        lv = level.reshape(-1)[:n].to(torch.int32).cpu().numpy().astype(uint_dtype(self.width(s)))
        signs = pack_bits_array((flat < 0).cpu().numpy())
        return params, (norms.cpu().numpy(), signs, pack_uint_array(lv, self.width(s)))

    def _levels_cpu(self, xn: np.ndarray, bs: int, safe: np.ndarray,
                    exponential: bool) -> tuple[np.ndarray, np.ndarray]:
        """Sign bits and packed levels in one numpy pass over cache-sized chunks of whole buckets:
        per entry the float32 operations of the torch path in the same order, the same draws."""
        s, n = self.levels, xn.size
        w_bits = self.width(s)
        signs, levels = UintStreamWriter(n, 1), UintStreamWriter(n, w_bits)
        # torch's ``s / safe`` is ``safe.reciprocal() * s``: the same two roundings here
        factor = None if exponential else np.reciprocal(safe) * np.float32(s)
        chunks = list(blocks(n, bs, torch.device("cpu")))
        work = np.empty(max(1, min(CHUNK // bs, safe.size)) * bs, dtype=np.float32)
        dt = uint_dtype(w_bits)
        draws = self._rounder.uniform_chunks([(b1 - b0) * bs for b0, b1, _, _ in chunks])
        for (b0, b1, start, stop), u in zip(chunks, draws):
            rows = padded_rows_np(xn, b0, b1, bs)
            m = np.abs(rows, out=work[: rows.size].reshape(rows.shape))
            if exponential:
                np.divide(m, safe[b0:b1, None], out=m)
                np.minimum(m, np.float32(1.0), out=m)
                j, p = exponential_position_np(m.reshape(-1), s)
                p += u
                np.floor(p, out=p)
                p += j
                level = p
            else:
                m *= factor[b0:b1, None]
                level = m.reshape(-1)
                level += u
                np.floor(level, out=level)
            np.clip(level, 0, s, out=level)
            levels.push(level[: stop - start].astype(dt))
            signs.push(xn[start:stop] < 0)
        return signs.finish(), levels.finish()

    @classmethod
    def _decode_into(cls, header: Header, payload: memoryview, out: np.ndarray) -> None:
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
        neg = check_padding(r.take(nbytes_for_bits(n), "sign bits"), n, "qsgd sign bits")
        lv = check_uint_stream(r.take(nbytes_for_bits(n * w), "levels"), n, w, "qsgd levels") if n else None
        r.finish()
        if not np.isfinite(norms).all() or (norms < 0).any():
            raise PayloadError("qsgd: a bucket norm is negative or not finite")
        table = exponential_levels(s) if exponential else None
        scale = norms if exponential else (norms / np.float32(s)).astype(np.float32)
        out = float32_out(out, cls.name)
        # levels, scales and signs chunk by chunk of whole buckets, into the one float32 output
        for b0, b1, start, stop in blocks(n, bs, torch.device("cpu")):
            level = unpack_uint_range(lv, start, stop - start, w)
            if int(level.max()) > s:
                raise PayloadError(f"qsgd: a level exceeds s = {s}")
            o = out[start:stop]
            o[...] = level if table is None else table[level]
            full = (stop - start) // bs
            if full:
                o[: full * bs].reshape(full, bs)[...] *= scale[b0 : b0 + full, None]
            if full < b1 - b0:  # the short last bucket
                o[full * bs :] *= scale[b0 + full]
            # negate where the sign bit says so: flip the float32 sign bit (exactly IEEE negation)
            bits = np.unpackbits(neg[start // 8 : nbytes_for_bits(stop)], bitorder="little")
            flip = bits[start % 8 : start % 8 + stop - start].astype(np.uint32)
            flip <<= np.uint32(31)
            ov = o.view(np.uint32)
            ov ^= flip
