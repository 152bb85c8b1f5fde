"""``randomk``: k entries chosen uniformly at random without replacement; positions are
not sent, only the 64-bit seed that generates them.

Sources: Stich, Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS 2018 (rand-k);
Konečný et al., "Federated Learning: Strategies for Improving Communication Efficiency",
2016 (random masks from a shared seed).
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from .base import Compressor, SparseDecoding, check_range, register
from .errors import PayloadError
from .sparse import check_density, k_for
from .wire import BodyReader, Header, unpack_params


def random_positions(seed: int, n: int, k: int) -> np.ndarray:
    """The k distinct positions in ``[0, n)`` that ``seed`` names, sorted ascending (int64).

    Uses only the raw output of numpy's PCG64 bit generator (``random_raw``), whose
    stream numpy keeps stable across releases, so client and server agree even with
    different numpy versions. Dense selections (k > n/4) rank n random keys; sparse ones
    draw raw values modulo n, keeping first occurrences, until k distinct remain.
    """
    if k >= n:
        return np.arange(n, dtype=np.int64)
    bitgen = np.random.PCG64(seed)
    if 4 * k > n:
        keys = bitgen.random_raw(n)
        return np.sort(np.argpartition(keys, k - 1)[:k]).astype(np.int64)
    chosen = np.zeros(0, dtype=np.int64)
    while chosen.size < k:
        draw = (bitgen.random_raw(2 * (k - chosen.size) + 16) % np.uint64(n)).astype(np.int64)
        merged = np.concatenate([chosen, draw])
        _, first = np.unique(merged, return_index=True)
        chosen = merged[np.sort(first)][:k]
    return np.sort(chosen)


@register
class RandomKCompressor(SparseDecoding, Compressor):
    """Rand-k: keep k = clamp(round(density * n), 1, n) uniformly random entries.

    Body: k fp32 values; the positions come from the 64-bit seed in the parameters, so
    the size is exactly ``32 * k`` bits + 21 bytes of parameters + header.

    Values are sent as they are (biased, meant for use with error feedback) unless
    ``rescale=True``, which multiplies them by n/k so that ``E[x_hat] = x`` (unbiased,
    but with variance growing like n/k).

    Parameters
    ----------
    density : float
        Fraction of entries kept, in (0, 1]. Default 0.01.
    rescale : bool
        Multiply kept values by n/k (unbiased). Default False.
    seed : int, optional
        Seeds the per-call seeds (reproducible runs); None draws from the OS.
    """

    name = "randomk"
    codec_id = 6
    _PARAMS = "<QQf"  # k, seed, scale factor

    def __init__(self, density: float = 0.01, rescale: bool = False, seed: int | None = None) -> None:
        self.density = check_density(density)
        self.rescale = bool(rescale)
        if seed is not None:
            check_range("seed", seed, 0, 2**64 - 1, integer=True)
        self.seed = seed
        self._seeds = np.random.default_rng(seed)

    def config(self) -> dict:
        """``{"density": ..., "rescale": ...}``."""
        return {"density": self.density, "rescale": self.rescale}

    def _encode(self, flat: torch.Tensor) -> tuple[bytes, bytes]:
        n = flat.numel()
        k = k_for(self.density, n)
        seed = int(self._seeds.integers(0, 2**63))
        factor = (n / k) if (self.rescale and k) else 1.0
        pos = torch.from_numpy(random_positions(seed, n, k)).to(flat.device)
        vals = flat[pos].cpu().numpy()
        return struct.pack(self._PARAMS, k, seed, factor), vals.tobytes()

    @classmethod
    def _decode_sparse(cls, header: Header, payload: memoryview) -> tuple[np.ndarray, np.ndarray]:
        k, seed, factor = unpack_params(cls._PARAMS, header.params, cls.name)
        n = header.numel
        if k > n:
            raise PayloadError(f"randomk: k = {k} exceeds the tensor size {n}")
        if not np.isfinite(factor):
            raise PayloadError(f"randomk: scale factor {factor} is not finite")
        r = BodyReader(payload, header.body_offset, cls.name)
        vals = np.frombuffer(r.take(4 * k, "values"), dtype=np.float32)
        r.finish()
        return random_positions(seed, n, k), vals * np.float32(factor)
