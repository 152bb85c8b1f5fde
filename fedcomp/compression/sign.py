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

from fedcomp.compression.base import Compressor, register
from fedcomp.compression.bits import nbytes_for_bits, pack_bits_on_device, unpack_bits
from fedcomp.compression.errors import PayloadError
from fedcomp.compression.wire import BodyReader, Header, unpack_params

_FP32_MAX = float(np.finfo(np.float32).max)


@register
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
    _PARAMS = "<f"

    def _encode(self, flat: torch.Tensor) -> tuple[bytes, bytes]:
        n = flat.numel()
        # mean |x| by torch's pairwise (cascade) summation, whose fp32 rounding error grows with
        # log n rather than with n as a sequential sum's does.
        scale = float(flat.abs().mean()) if n else 0.0
        if not np.isfinite(scale):  # the fp32 sum overflowed: redo it in float64
            scale = min(float(flat.abs().mean(dtype=torch.float64)), _FP32_MAX)
        return struct.pack(self._PARAMS, scale), pack_bits_on_device(flat >= 0)

    @classmethod
    def _decode(cls, header: Header, payload: memoryview) -> np.ndarray:
        (scale,) = unpack_params(cls._PARAMS, header.params, cls.name)
        if not np.isfinite(scale) or scale < 0:
            raise PayloadError(f"sign: scale {scale} is not a finite non-negative number")
        n = header.numel
        r = BodyReader(payload, header.body_offset, cls.name)
        bits = unpack_bits(r.take(nbytes_for_bits(n), "bits"), n, "sign bits")
        r.finish()
        s = np.float32(scale)
        # bit * 2s - s is exactly +s or -s (2s is exact), and cheaper than a table lookup; in place:
        # one float32 array of n entries, no temporaries (a server decodes these while it folds).
        out = bits.astype(np.float32)
        out *= s + s
        out -= s
        return out
