"""``sign``: scaled 1-bit sign compression.

Sources: Bernstein et al., "signSGD: Compressed Optimisation for Non-Convex Problems",
ICML 2018; Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient
Compression Schemes", ICML 2019 (the scaled sign ``(||x||_1 / n) * sign(x)`` with error
feedback).
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from fedcomp.compression.base import Compressor
from fedcomp.compression.bits import check_padding, nbytes_for_bits, pack_bits_on_device
from fedcomp.compression.chunked import CHUNK, buffer, float32_out, on_cpu, spans
from fedcomp.compression.errors import PayloadError
from fedcomp.compression.wire import BodyReader, Header, unpack_params

_FP32_MAX = float(np.finfo(np.float32).max)


class SignCompressor(Compressor):
    """Scaled sign: ``x_hat = scale * s``, ``scale = mean |x|`` (fp32), ``s in {-1, +1}``.

    Size: exactly ``ceil(n / 8)`` bytes of signs + 4 bytes of scale + header, i.e.
    1 bit/parameter (+32 bits per tensor).

    sign(0): an entry equal to 0 is sent as +1, so a lone zero in a non-zero tensor
    decodes to ``+scale``. An all-zero tensor has ``scale = 0`` and decodes to exact
    zeros (no 0/0 anywhere). The scale is one per payload: one per tensor under the
    default ``selection = "auto"`` ("tensor" for sign), one for the whole model under "model".
    """

    name = "sign"
    codec_id = 3
    one_scale = True
    _PARAMS = "<f"

    def _encode(self, flat: torch.Tensor) -> tuple[bytes, bytes | tuple]:
        n = flat.numel()
        if not on_cpu(flat) or n == 0:
            mag, bits = flat.abs(), pack_bits_on_device(flat >= 0)
        else:  # one pass in cache-sized chunks: |x| into a numpy buffer, signs packed as they are compared
            mag, bits = buffer(n), np.empty(nbytes_for_bits(n), dtype=np.uint8)
            xn, mn, hit = flat.numpy(), mag.numpy(), np.empty(min(CHUNK, n), dtype=np.bool_)
            for start, stop in spans(n):
                np.abs(xn[start:stop], out=mn[start:stop])
                h = hit[: stop - start]
                np.greater_equal(xn[start:stop], 0, out=h)
                bits[start // 8 : nbytes_for_bits(stop)] = np.packbits(h, bitorder="little")
            bits = (bits,)
        # mean |x| by torch's pairwise (cascade) summation, whose fp32 rounding error grows with
        # log n rather than with n as a sequential sum's does.
        scale = float(mag.mean()) if n else 0.0
        if not np.isfinite(scale):  # the fp32 sum overflowed: redo it in float64
            scale = min(float(mag.mean(dtype=torch.float64)), _FP32_MAX)
        return struct.pack(self._PARAMS, scale), bits

    @classmethod
    def _decode_into(cls, header: Header, payload: memoryview, out: np.ndarray) -> None:
        (scale,) = unpack_params(cls._PARAMS, header.params, cls.name)
        if not np.isfinite(scale) or scale < 0:
            raise PayloadError(f"sign: scale {scale} is not a finite non-negative number")
        n = header.numel
        r = BodyReader(payload, header.body_offset, cls.name)
        raw = r.take(nbytes_for_bits(n), "bits")
        r.finish()
        check_padding(raw, n, "sign bits")
        # The old bit * 2s - s is exactly +s or -s (+0 when s = 0): written here as s's float32 bits
        # with the sign bit set for a 0 bit, chunk by chunk into the one float32 output (no
        # n-sized temporary; a server decodes these as it folds).
        expand_signs(np.frombuffer(raw, dtype=np.uint8), n, np.float32(scale), float32_out(out, cls.name))


def expand_signs(raw: np.ndarray, n: int, s: np.float32, out: np.ndarray | None = None) -> np.ndarray:
    """``+s`` where bit i of ``raw`` (little bit order) is 1, ``-s`` where it is 0 (``s >= 0``; all
    +0.0 when s = 0), for i < n: float32, shape ``(n,)``, in chunks, into ``out`` if given."""
    out = np.empty(n, dtype=np.float32) if out is None else out
    if s == 0:
        out.fill(0.0)
        return out
    ov, minus = out.view(np.uint32), np.float32(-s).view(np.uint32)
    for start, stop in spans(n):
        o = ov[start:stop]
        o[...] = np.unpackbits(raw[start // 8 : nbytes_for_bits(stop)], count=stop - start, bitorder="little")
        np.left_shift(o, 31, out=o)
        np.bitwise_xor(o, minus, out=o)
    return out
