"""``int8``: block-wise 8-bit quantization with stochastic rounding.

Sources: Dettmers, "8-Bit Approximations for Parallelism in Deep Learning", ICLR 2016;
Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022 (block-wise
absmax scales); Gupta et al., "Deep Learning with Limited Numerical Precision", ICML
2015 (stochastic rounding).
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from fedcomp.compression.base import Compressor, check_range, register
from fedcomp.compression.chunked import CHUNK, blocks, buffer, float32_out, on_cpu, padded_rows
from fedcomp.compression.errors import PayloadError
from fedcomp.compression.options import Option
from fedcomp.compression.stochastic import StochasticRounder
from fedcomp.compression.wire import BodyReader, Header, unpack_params

MAX_BLOCK = 2**31 - 1
#: Largest block scale: ``127 * scale`` stays a finite float32.
_SCALE_CAP = float(np.finfo(np.float32).max) / 127.0 * (1 - 2**-20)


@register
class Int8Compressor(Compressor):
    """Block-wise int8: per block of ``block_size`` entries, ``scale = max|x| / 127``
    (fp32) and ``q = floor(x / scale + U[0,1))`` clipped to [-127, 127]; ``x_hat = q * scale``.

    Unbiased (``E[x_hat] = x``): |x / scale| <= 127 so the clip never changes an
    expectation. A block of zeros has scale 0 and decodes to exact zeros.

    Size: exactly ``8 + 32 / block_size`` bits/parameter (n int8 values plus one fp32
    scale per block, the last block possibly short) + 4 bytes of parameters + header.

    Parameters
    ----------
    block_size : int
        Entries per scale, >= 1. Default 256 (8.125 bits/parameter).
    seed : int, optional
        Seed of the stochastic rounding; None draws from the OS.
    """

    name = "int8"
    codec_id = 8
    options = (Option("block-size", int, 256, "entries per fp32 scale", lo=1, hi=MAX_BLOCK, arg="block_size"),)
    seeded = True
    _PARAMS = "<I"  # block size

    def __init__(self, block_size: int = 256, seed: int | None = None) -> None:
        check_range("block_size", block_size, 1, MAX_BLOCK, integer=True)
        self.block_size = int(block_size)
        self._rounder = StochasticRounder(seed)

    def config(self) -> dict:
        """``{"block_size": B}``."""
        return {"block_size": self.block_size}

    def _encode(self, flat: torch.Tensor) -> tuple[bytes, bytes | tuple]:
        n, bs = flat.numel(), self.block_size
        bs = min(bs, max(n, 1))  # a block larger than the tensor is one block: pad no further than n
        nb = -(-n // bs)
        scales = torch.empty(nb, device=flat.device)
        q = buffer(n, torch.int8) if on_cpu(flat) else torch.empty(n, dtype=torch.int8, device=flat.device)
        scratch = None
        # block scales and stochastic rounding in one pass over cache-sized chunks of whole blocks
        for b0, b1, start, stop in blocks(n, bs, flat.device):
            rows = padded_rows(flat, b0, b1, bs)
            # keep 127 * scale finite, so that decoding never overflows
            scale = torch.clamp(rows.abs().amax(dim=1) / 127.0, max=_SCALE_CAP, out=scales[b0:b1])
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            v = rows / safe[:, None]
            scratch = scratch if scratch is not None else torch.empty(v.numel(), device=v.device)
            q[start:stop] = self._rounder.round_(v, scratch).clamp_(-127, 127).reshape(-1)[: stop - start]
        return struct.pack(self._PARAMS, self.block_size), (scales.cpu().numpy(), q.cpu().numpy())

    @classmethod
    def _decode_into(cls, header: Header, payload: memoryview, out: np.ndarray) -> None:
        (bs,) = unpack_params(cls._PARAMS, header.params, cls.name)
        if bs < 1:
            raise PayloadError("int8: block size 0")
        n = header.numel
        nb = -(-n // bs)
        r = BodyReader(payload, header.body_offset, cls.name)
        scale = np.frombuffer(r.take(4 * nb, "scales"), dtype=np.float32)
        q = np.frombuffer(r.take(n, "values"), dtype=np.int8)
        r.finish()
        if not np.isfinite(scale).all() or (scale < 0).any():
            raise PayloadError("int8: a block scale is negative or not finite")
        if n and int(q.min()) == -128:
            raise PayloadError("int8: value -128 outside [-127, 127]")
        block_scale(q, scale, bs, float32_out(out, cls.name))


def block_scale(values: np.ndarray, scale: np.ndarray, block: int, out: np.ndarray | None = None) -> np.ndarray:
    """``values[i] * scale[i // block]`` as float32, shape ``(n,)``, without an n-sized index.

    Full blocks are scaled as an ``(nb, block)`` view, the short tail block on its own, so the
    only n-sized allocation is the float32 output (a huge declared block allocates nothing), or
    none when ``out`` (float32, ``(n,)``) is given.
    """
    n = values.size
    out = np.empty(n, dtype=np.float32) if out is None else out
    full = n // block if block <= n else 0
    per = max(1, CHUNK // block)
    for b0 in range(0, full, per):  # cast and scale chunk by chunk, in cache
        b1 = min(full, b0 + per)
        o = out[b0 * block : b1 * block]
        o[...] = values[b0 * block : b1 * block]
        o.reshape(b1 - b0, block)[...] *= scale[b0:b1, None]
    if full * block < n:
        out[full * block :] = values[full * block :]
        out[full * block :] *= scale[full]
    return out
