"""Dense codecs: ``none`` (fp32, or fp64 for float64 tensors; exact), ``fp16`` and ``bf16`` (casts).

Sizes: 32, 16 and 16 bits per parameter plus the header. Arithmetic is float32; the
cast happens last, so CPU tensors in float16 work. ``fp16`` saturates values beyond
±65504 (the largest finite half) instead of sending Inf. bfloat16 (Kalamkar et al.,
"A Study of BFLOAT16 for Deep Learning Training", 2019) keeps fp32's exponent range.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from fedcomp.compression.base import Compressor
from fedcomp.compression.chunked import CHUNK, buffer, float32_out, on_cpu, spans
from fedcomp.compression.errors import PayloadError
from fedcomp.compression.options import Option
from fedcomp.compression.wire import BodyReader, Header, pack_header, unpack_params


class _Cast(Compressor):
    """Shared cast logic; subclasses set the wire dtype."""

    wire_dtype: torch.dtype = torch.float32
    itemsize = 4
    #: Largest finite value of the wire dtype: larger magnitudes saturate (None: no clamp).
    limit: float | None = None

    def _encode(self, flat: torch.Tensor) -> tuple[bytes, bytes | tuple]:
        if not on_cpu(flat):
            return b"", self._to_wire(flat).cpu().numpy().tobytes()
        if self.limit is None:
            return b"", (flat.contiguous().numpy(),)
        # clamp and cast chunk by chunk into the numpy-allocated wire array: the same two float ops
        # per entry as ``_to_wire``, with cache-sized temporaries
        n = flat.numel()
        wire = buffer(n, self.wire_int)
        clamped = torch.empty(min(CHUNK, n))
        cast = torch.empty(clamped.numel(), dtype=self.wire_dtype)
        for start, stop in spans(n):
            c, w = clamped[: stop - start], cast[: stop - start]
            torch.clamp(flat[start:stop], -self.limit, self.limit, out=c)
            w.copy_(c)
            wire[start:stop].copy_(w.view(self.wire_int))
        return b"", (wire.numpy(),)

    def _to_wire(self, flat: torch.Tensor) -> torch.Tensor:
        if self.limit is None:
            return flat
        return flat.clamp(-self.limit, self.limit).to(self.wire_dtype).view(self.wire_int)

    @classmethod
    def _from_wire(cls, raw: memoryview, out: np.ndarray) -> None:
        out[...] = np.frombuffer(raw, dtype=np.float32)

    @classmethod
    def _decode_into(cls, header: Header, payload: memoryview, out: np.ndarray) -> None:
        unpack_params("<", header.params, cls.name)
        r = BodyReader(payload, header.body_offset, cls.name)
        raw = r.take(header.numel * cls.itemsize, "values")
        r.finish()
        cls._from_wire(raw, float32_out(out, cls.name))


#: ``none`` parameter block of a float64 body (one byte: the body's itemsize).
_WIDE = struct.pack("<B", 8)


class NoCompression(_Cast):
    """``none``: the values as they are; exact. 32 bits/parameter + header.

    Payload body: n little-endian float32; for a float64 tensor, n little-endian float64 (64
    bits/parameter, parameter block ``b"\\x08"``) so that float64 models stay float64 end to end:
    such a payload decodes to float64. An empty parameter block means a float32 body. The reference point every ratio
    is taken against (plain FedAvg, McMahan et al. 2017).
    """

    name = "none"
    secagg = True
    small_tensor = True
    codec_id = 0

    def compress(self, x: torch.Tensor) -> bytes:
        """As [`Compressor.compress`][fedcomp.compression.Compressor.compress]; a float64 ``x`` travels as float64
        (checked finite in float64).

        Raises
        ------
        ValueError
            Unsupported dtype, or NaN/Inf in ``x``.
        """
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float64:
            return super().compress(x)
        flat = x.detach().reshape(-1)
        if flat.numel() and not bool(torch.isfinite(flat).all()):
            bad = int((~torch.isfinite(flat)).sum())
            raise ValueError(f"input holds {bad} non-finite value(s) (NaN or Inf); refusing to compress")
        body = flat.cpu().numpy().astype("<f8", copy=False).tobytes()
        return pack_header(self.codec_id, torch.float64, tuple(x.shape), _WIDE) + body

    @classmethod
    def _decode(cls, header: Header, payload: memoryview) -> np.ndarray:
        if header.params == _WIDE:
            if header.dtype != torch.float64:
                raise PayloadError(f"none: a float64 body for a {header.dtype} tensor")
            r = BodyReader(payload, header.body_offset, cls.name)
            raw = r.take(header.numel * 8, "values")
            r.finish()
            return np.frombuffer(raw, dtype="<f8").astype(np.float64)
        return super()._decode(header, payload)

    @classmethod
    def _decode_into(cls, header: Header, payload: memoryview, out: np.ndarray) -> None:
        if header.params == _WIDE:  # a float64 body: decoded, then copied (out must be float64)
            Compressor._decode_into.__func__(cls, header, payload, out)
        else:
            super()._decode_into(header, payload, out)


class FP16(_Cast):
    """``fp16``: IEEE half precision. 16 bits/parameter + header; |x| > 65504 saturates.

    Relative error per entry <= 2**-11 for normal values (IEEE 754-2008 binary16).
    """

    name = "fp16"
    small_tensor = True
    codec_id = 1
    itemsize = 2
    wire_dtype = torch.float16
    wire_int = torch.int16
    limit = 65504.0

    @classmethod
    def _from_wire(cls, raw: memoryview, out: np.ndarray) -> None:
        # torch's half -> float conversion (exact, vectorised; numpy's is several times slower), chunk
        # by chunk through a small writable copy into the output
        halves, n = np.frombuffer(raw, dtype=np.float16), out.size
        dst = torch.from_numpy(out)
        scratch = torch.empty(min(CHUNK, n), dtype=torch.float16)
        for start, stop in spans(n):
            s = scratch[: stop - start]
            s.numpy()[...] = halves[start:stop]
            dst[start:stop].copy_(s)


class BF16(_Cast):
    """``bf16``: bfloat16 (8-bit exponent, 7-bit mantissa), round to nearest even.

    16 bits/parameter + header; relative error per entry <= 2**-8; saturates at the largest
    finite bfloat16 (~3.39e38). Sent as the upper 16 bits of each float32 (Kalamkar et al. 2019).
    """

    name = "bf16"
    small_tensor = True
    codec_id = 2
    itemsize = 2
    wire_dtype = torch.bfloat16
    wire_int = torch.int16
    limit = float(torch.finfo(torch.bfloat16).max)

    @classmethod
    def _from_wire(cls, raw: memoryview, out: np.ndarray) -> None:
        wire, ov = np.frombuffer(raw, dtype=np.uint16), out.view(np.uint32)
        for start, stop in spans(out.size):  # the upper 16 bits of each float32
            o = ov[start:stop]
            o[...] = wire[start:stop]
            o <<= np.uint32(16)


#: The small-tensor codecs by name, by codec id (the dense casts with ``small_tensor``): what
#: ``small-tensor-compressor`` and a low-rank codec's ``fallback`` may name.
SMALL_TENSOR_CODECS: dict[str, type[_Cast]] = {
    cls.name: cls for cls in sorted(_Cast.__subclasses__(), key=lambda c: c.codec_id) if cls.small_tensor}
#: The option of the codec that small tensors (and the tensors a low-rank codec does not pay on) travel with.
SMALL_TENSOR = Option("small-tensor-compressor", str, "none", "codec of the tensors a low-rank codec does not pay "
                      "on, and of the small tensors", choices=tuple(SMALL_TENSOR_CODECS), arg="fallback")
