"""``topk``: top-k sparsification with exact values.

Sources: Aji & Heafield, "Sparse Communication for Distributed Gradient Descent",
EMNLP 2017; Stich, Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS 2018
(top-k with error feedback).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import numpy as np
import torch

from fedcomp.compression.base import Compressor
from fedcomp.compression.errors import PayloadError
from fedcomp.compression.options import DENSITY, VALUE_DTYPE
from fedcomp.compression.selection import top_k
from fedcomp.compression.sparse import (
    ChunkedSparseDecoding,
    check_density,
    k_for,
    positions_to_bytes,
    read_positions,
)
from fedcomp.compression.wire import VALUE_DTYPE_BY_CODE, VALUE_DTYPES, BodyReader, Header, unpack_params


class TopKCompressor(ChunkedSparseDecoding, Compressor):
    """Keep the k largest magnitudes with their values; zeros elsewhere.

    ``k = clamp(round(density * n), 1, n)``. Body: Golomb-Rice-coded positions (index
    cost <= 1.03 x log2 C(n, k) for density <= 0.3), then k values in fp32 (exact, the
    default) or fp16 (``value_dtype="fp16"``; saturates at ±65504).

    Size: about ``k * (log2(e/p) + 32)`` bits with fp32 values (p = k/n), + 18 bytes of
    parameters and the header.

    Parameters
    ----------
    density : float
        Fraction of entries kept, in (0, 1]. Default 0.01.
    value_dtype : {"fp32", "fp16"}
        Wire type of the kept values. Default "fp32" (bit-exact).
    """

    name = "topk"
    codec_id = 5
    options = (DENSITY, VALUE_DTYPE)
    sparse = True
    density_ramp = True
    _PARAMS = "<QQBB"  # k, unary_bits, rice b, value dtype code

    def __init__(self, density: float = 0.01, value_dtype: str = "fp32") -> None:
        self.density = check_density(density)
        if value_dtype not in VALUE_DTYPES:
            raise ValueError(f"value_dtype must be one of {sorted(VALUE_DTYPES)}, got {value_dtype!r}")
        self.value_dtype = value_dtype

    def config(self) -> dict:
        """``{"density": ..., "value_dtype": ...}``."""
        return {"density": self.density, "value_dtype": self.value_dtype}

    def _encode(self, flat: torch.Tensor) -> tuple[bytes, bytes]:
        n = flat.numel()
        code, np_dt, _ = VALUE_DTYPES[self.value_dtype]
        k = k_for(self.density, n)
        if k == 0:
            return struct.pack(self._PARAMS, 0, 0, 0, code), b""
        idx, vals = top_k(flat, k)
        if np_dt is np.float16:
            vals = vals.clamp(-65504.0, 65504.0).to(torch.float16)
        b, unary_bits, pos = positions_to_bytes(idx, n)
        return struct.pack(self._PARAMS, k, unary_bits, b, code), pos + vals.cpu().numpy().tobytes()

    @classmethod
    def _decode_chunks(cls, header: Header,
                       payload: memoryview) -> tuple[int, Iterator[tuple[np.ndarray, np.ndarray]]]:
        k, unary_bits, b, code = unpack_params(cls._PARAMS, header.params, cls.name)
        if code not in VALUE_DTYPE_BY_CODE:
            raise PayloadError(f"topk: unknown value dtype code {code}")
        _, np_dt, size = VALUE_DTYPE_BY_CODE[code]
        n = header.numel
        r = BodyReader(payload, header.body_offset, cls.name)
        chunks = read_positions(r, cls.name, k, n, b, unary_bits)
        vals = np.frombuffer(r.take(k * size, "values"), dtype=np_dt)
        r.finish()
        return k, ((pos, vals[first : first + pos.size]) for first, pos in chunks)
