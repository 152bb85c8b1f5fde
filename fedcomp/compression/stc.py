"""``stc``: Sparse Ternary Compression.

Source: Sattler, Wiedemann, Müller, Samek, "Robust and Communication-Efficient
Federated Learning from Non-IID Data", IEEE TNNLS 2019, Algorithm 1.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import numpy as np
import torch

from fedcomp.compression.base import Compressor
from fedcomp.compression.bits import nbytes_for_bits, pack_bits_array, unpack_bits
from fedcomp.compression.errors import PayloadError
from fedcomp.compression.options import DENSITY
from fedcomp.compression.selection import top_k
from fedcomp.compression.sparse import (
    ChunkedSparseDecoding,
    check_density,
    k_for,
    positions_to_bytes,
    read_positions,
)
from fedcomp.compression.wire import BodyReader, Header, unpack_params


class STCCompressor(ChunkedSparseDecoding, Compressor):
    """Sparse ternary: top-k by magnitude, every kept value becomes ``±mu``.

    ``k = clamp(round(density * n), 1, n)``, and at most the number of non-zero entries:
    zeros (``-0.0`` included) are never kept, so they decode to 0 and do not lower ``mu``.
    ``mu = mean |kept values|`` (fp32). Body: Golomb-Rice-coded positions (see ``positions``),
    then one sign bit per kept value (1 = positive). An all-zero tensor keeps one entry with
    ``mu = 0``, the only kept 0, and decodes to exact zeros.

    Size: about ``k * (b + 1/(1-(1-p)**2**b) + 1)`` bits, p = k/n; at density 1/400
    that is ~11.1 bits per kept value, i.e. ~0.028 bit/parameter, + 33 bytes of
    parameters and the header.

    Parameters
    ----------
    density : float
        Fraction of entries kept, in (0, 1]. Default 0.01.
    """

    name = "stc"
    codec_id = 4
    options = (DENSITY,)
    sparse = True
    density_ramp = True
    _PARAMS = "<QQBf"  # k, unary_bits, rice b, mu

    def __init__(self, density: float = 0.01) -> None:
        self.density = check_density(density)

    def config(self) -> dict:
        """``{"density": density}``."""
        return {"density": self.density}

    @classmethod
    def kept_energy(cls, mag: torch.Tensor) -> torch.Tensor:
        """Energy kept with k entries when each becomes ``±mu`` (mu their mean magnitude):
        ``(sum_{i<=k} |v|_(i))^2 / k`` for every k (``mag``: |v| sorted descending, float64, ``(n,)``)."""
        return torch.cumsum(mag, 0) ** 2 / torch.arange(1, mag.numel() + 1, dtype=mag.dtype, device=mag.device)

    def _encode(self, flat: torch.Tensor) -> tuple[bytes, bytes]:
        n = flat.numel()
        k = k_for(self.density, n)
        if k == 0:
            return struct.pack(self._PARAMS, 0, 0, 0, 0.0), b""
        idx, kept = top_k(flat, k)
        nonzero = kept != 0
        if not bool(nonzero.all()):  # fewer non-zeros than k, all in the top-k set: keep them alone
            if not bool(nonzero.any()):  # all zero: one entry, mu = 0
                nonzero = torch.arange(k, device=idx.device) == 0
            idx, kept = idx[nonzero], kept[nonzero]
            k = idx.numel()
        mu = float(kept.abs().mean(dtype=torch.float64))
        b, unary_bits, pos = positions_to_bytes(idx, n)
        signs = (kept >= 0).cpu().numpy()
        return struct.pack(self._PARAMS, k, unary_bits, b, mu), (pos, pack_bits_array(signs))

    @classmethod
    def _decode_chunks(cls, header: Header,
                       payload: memoryview) -> tuple[int, Iterator[tuple[np.ndarray, np.ndarray]]]:
        k, unary_bits, b, mu = unpack_params(cls._PARAMS, header.params, cls.name)
        if not np.isfinite(mu) or mu < 0:
            raise PayloadError(f"stc: mu {mu} is not a finite non-negative number")
        n = header.numel
        r = BodyReader(payload, header.body_offset, cls.name)
        chunks = read_positions(r, cls.name, k, n, b, unary_bits)
        signs = unpack_bits(r.take(nbytes_for_bits(k), "sign bits"), k, "stc sign bits")
        r.finish()
        table = np.array([-mu, mu], dtype=np.float32)
        return k, ((pos, table[signs[first : first + pos.size]]) for first, pos in chunks)
