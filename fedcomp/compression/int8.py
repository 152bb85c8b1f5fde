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

from fedcomp.compression.base import Compressor, check_range
from fedcomp.compression.chunked import CHUNK, blocks, float32_out, on_cpu, padded_rows, padded_rows_np
from fedcomp.compression.errors import PayloadError
from fedcomp.compression.options import Option
from fedcomp.compression.stochastic import StochasticRounder
from fedcomp.compression.wire import BodyReader, Header, unpack_params

MAX_BLOCK = 2**31 - 1
#: Largest block scale: ``127 * scale`` stays a finite float32.
_SCALE_CAP = float(np.finfo(np.float32).max) / 127.0 * (1 - 2**-20)
_SCALE_CAP32 = np.float32(_SCALE_CAP)  # the cap as torch's clamp rounds it (to float32)


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
        params = struct.pack(self._PARAMS, self.block_size)
        if on_cpu(flat):
            return params, self._encode_cpu(flat.numpy(), bs)
        nb = -(-n // bs)
        scales = torch.empty(nb, device=flat.device)
        q = torch.empty(n, dtype=torch.int8, device=flat.device)
        for b0, b1, start, stop in blocks(n, bs, flat.device):  # one chunk: every block at once
            rows = padded_rows(flat, b0, b1, bs)
            # keep 127 * scale finite, so that decoding never overflows
            scale = torch.clamp(rows.abs().amax(dim=1) / 127.0, max=_SCALE_CAP, out=scales[b0:b1])
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            q[start:stop] = self._rounder.round_(rows / safe[:, None]).clamp_(-127, 127).reshape(-1)[: stop - start]
        return params, (scales.cpu().numpy(), q.cpu().numpy())

    def _encode_cpu(self, xn: np.ndarray, bs: int) -> tuple[np.ndarray, np.ndarray]:
        """Block scales and stochastic rounding in one numpy pass over cache-sized chunks of whole
        blocks: the same float32 operations per entry as the torch path, in the same order, and
        the same draws (the CPU generator is read in order, padding of the short block included)."""
        n = xn.size
        nb = -(-n // bs)
        scales, q = np.empty(nb, dtype=np.float32), np.empty(n, dtype=np.int8)
        chunks = list(blocks(n, bs, torch.device("cpu")))
        work = np.empty(max(1, min(CHUNK // bs, nb)) * bs, dtype=np.float32)
        starts = np.arange(0, work.size, bs)
        draws = self._rounder.uniform_chunks([(b1 - b0) * bs for b0, b1, _, _ in chunks])
        for (b0, b1, start, stop), u in zip(chunks, draws):
            rows = padded_rows_np(xn, b0, b1, bs)
            w = work[: rows.size].reshape(rows.shape)
            scale = scales[b0:b1]
            np.abs(rows, out=w)
            # the block maxima: reduceat over the flat chunk is several times faster than max(axis=1)
            np.divide(np.maximum.reduceat(work[: rows.size], starts[: b1 - b0]), np.float32(127.0), out=scale)
            np.minimum(scale, _SCALE_CAP32, out=scale)  # keep 127 * scale finite: decoding never overflows
            np.divide(rows, np.where(scale > 0, scale, np.float32(1.0))[:, None], out=w)
            w = w.reshape(-1)
            w += u
            np.floor(w, out=w)
            np.clip(w, -127, 127, out=w)
            q[start:stop] = w[: stop - start]
        return scales, q

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
