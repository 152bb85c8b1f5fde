"""``randsign``: scaled sign of a shared random subset, below one bit per parameter.

k = density * n entries chosen from a 64-bit seed, as ``randomk`` chooses them (the positions
never travel); each kept entry is sent as one sign bit, and one fp32 scale per payload.

Sources: Vargaftik et al., "EDEN: Communication-Efficient and Robust Distributed Mean
Estimation for Federated Learning", ICML 2022 (fractional bit rates by shared-seed
subsampling of the coordinates); Karimireddy et al., "Error Feedback Fixes SignSGD and other
Gradient Compression Schemes", ICML 2019 (the scaled sign with error feedback); Stich et al.,
"Sparsified SGD with Memory", NeurIPS 2018 (rand-k with memory).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import numpy as np
import torch

from fedcomp.compression.base import Compressor
from fedcomp.compression.bits import nbytes_for_bits, pack_bits_on_device, unpack_bits
from fedcomp.compression.errors import PayloadError
from fedcomp.compression.options import DENSITY
from fedcomp.compression.randomk import SeededPositions, seeded_chunks
from fedcomp.compression.sparse import ChunkedSparseDecoding
from fedcomp.compression.wire import BodyReader, Header, unpack_params


class RandSignCompressor(SeededPositions, ChunkedSparseDecoding, Compressor):
    """Sign on a shared random subset: keep k = clamp(round(density * n), 1, n) entries drawn
    from a seed (`random_positions`), send each as ``±scale``.

    ``scale = mean |kept|`` (fp32), which is also the least-squares scale of the kept signs
    (``argmin_s ||v - s sign(v)||``); the other n - k entries decode to 0. Biased (the kept
    entries are not rescaled by n/k): meant for error feedback, which carries what was not sent
    to the next round. sign(0) = +1 as in ``sign``; an all-zero selection has scale 0 and decodes
    to exact zeros. At density 1 it is ``sign`` plus an 8-byte seed.

    Body: ``ceil(k / 8)`` bytes of sign bits (1 = non-negative) in position order. Size: exactly
    ``ceil(k / 8)`` + 20 bytes of parameters (k, seed, scale) + header, i.e. ``density`` bits per
    parameter plus about 200 bits per payload.

    Parameters
    ----------
    density : float
        Fraction of entries kept, in (0, 1]. Default 0.01.
    seed : int, optional
        Seeds the per-call seeds (reproducible runs); None draws from the OS.
    """

    name = "randsign"
    codec_id = 12
    options = (DENSITY,)
    sparse = True
    seeded = True
    _PARAMS = "<QQf"  # k, seed, scale

    def config(self) -> dict:
        """``{"density": density}``."""
        return {"density": self.density}

    @classmethod
    def kept_energy(cls, mag: torch.Tensor) -> torch.Tensor:
        """The energy a random selection keeps, on average, with k entries each sent as ``±mean``:
        ``k * mean(|v|)**2`` over the whole vector (``mag``: |v|, float64, ``(n,)``; any order)."""
        n = mag.numel()
        mean = mag.sum() / max(n, 1)
        return torch.arange(1, n + 1, dtype=mag.dtype, device=mag.device) * mean**2

    def _encode(self, flat: torch.Tensor) -> tuple[bytes, bytes]:
        k, seed, pos = self._draw_positions(flat)
        if k == 0:
            return struct.pack(self._PARAMS, 0, seed, 0.0), b""
        kept = flat[pos]
        scale = float(kept.abs().mean(dtype=torch.float64))
        return struct.pack(self._PARAMS, k, seed, scale), pack_bits_on_device(kept >= 0)

    @classmethod
    def _decode_chunks(cls, header: Header,
                       payload: memoryview) -> tuple[int, Iterator[tuple[np.ndarray, np.ndarray]]]:
        k, seed, scale = unpack_params(cls._PARAMS, header.params, cls.name)
        n = header.numel
        if k > n:
            raise PayloadError(f"randsign: k = {k} exceeds the tensor size {n}")
        if not np.isfinite(scale) or scale < 0:
            raise PayloadError(f"randsign: scale {scale} is not a finite non-negative number")
        r = BodyReader(payload, header.body_offset, cls.name)
        signs = unpack_bits(r.take(nbytes_for_bits(k), "sign bits"), k, "randsign sign bits")
        r.finish()
        vals = np.array([-scale, scale], dtype=np.float32)[signs]
        return k, seeded_chunks(seed, n, k, vals)
