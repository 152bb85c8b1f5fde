"""``randomk``: k entries chosen uniformly at random without replacement; positions are
not sent, only the 64-bit seed that generates them.

Sources: Stich, Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS 2018 (rand-k);
Konečný et al., "Federated Learning: Strategies for Improving Communication Efficiency",
2016 (random masks from a shared seed).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import numpy as np
import torch

from fedcomp.compression.base import Compressor, check_range
from fedcomp.compression.errors import PayloadError
from fedcomp.compression.options import DENSITY
from fedcomp.compression.sparse import ChunkedSparseDecoding, check_density, k_for
from fedcomp.compression.wire import BodyReader, Header, unpack_params

#: Random keys / draws generated per step (bounds the temporaries of `random_mask`).
_STEP = 1 << 16
#: Selections with ``k * _MASK_RATIO <= n`` are regenerated as positions (O(k)), never as the
#: n-byte mask; denser ones use the mask (then n bytes <= 64 k bytes: O(k) as well).
_MASK_RATIO = 64


def random_mask(seed: int, n: int, k: int) -> np.ndarray:
    """Boolean mask, shape ``(n,)``, of the k distinct positions in ``[0, n)`` that ``seed`` names.

    Uses only the raw output of numpy's PCG64 bit generator (``random_raw``), whose stream
    numpy keeps stable across releases, so client and server agree even with different numpy
    versions. Dense selections (k > n/4) keep the k smallest of n random 64-bit keys (a tie at
    the k-th key, probability about n**2 / 2**65, goes to the lower positions); sparse ones keep
    the first k distinct values of the raw stream modulo n. Both read the stream in steps of
    `_STEP`, so the peak memory is the n-byte mask plus, for dense selections, the n
    keys once (8n bytes, before the mask exists), never an n-sized index array.
    """
    mask = np.zeros(n, dtype=np.bool_)
    if k >= n:
        mask[:] = True
        return mask
    if 4 * k > n:
        keys = np.random.PCG64(seed).random_raw(n)
        keys.partition(k - 1)  # in place: keys[:k-1] <= keys[k-1] <= keys[k:]
        thr = keys[k - 1]
        ties = k - int(np.count_nonzero(keys[:k] < thr))
        del keys
        bitgen = np.random.PCG64(seed)  # the same stream again, step by step
        for start in range(0, n, _STEP):
            chunk = bitgen.random_raw(min(_STEP, n - start))
            mask[start : start + chunk.size] = chunk < thr
            if ties:
                eq = np.flatnonzero(chunk == thr)[:ties]
                mask[start + eq] = True
                ties -= eq.size
        return mask
    bitgen, count = np.random.PCG64(seed), 0
    while count < k:
        draw = bitgen.random_raw(min(2 * (k - count) + 16, _STEP)) % np.uint64(n)
        values, first = np.unique(draw, return_index=True)
        fresh = values[np.argsort(first)]  # distinct values of this step, in stream order
        fresh = fresh[~mask[fresh]][: k - count]
        mask[fresh] = True
        count += fresh.size
    return mask


def _sparse_positions(seed: int, n: int, k: int) -> np.ndarray:
    """`random_mask`'s positions for a sparse selection (``4 * k <= n``, k >= 1) in O(k) memory.

    The same selection, the first k distinct values of the raw PCG64 stream modulo n, found
    without an n-sized mask: a prefix of the stream a little longer than k (about k**2 / 2n
    duplicates are expected, at most k / 8 here) is made unique, keeping each value's first
    occurrence, and the k earliest are taken; a prefix that holds fewer than k distinct values is
    drawn again twice as long. Peak memory: a few arrays of ``1.25 k + 64`` int64.

    Returns
    -------
    np.ndarray
        int64, shape ``(k,)``, sorted ascending.
    """
    m = k + k // 4 + 64
    while True:
        draw = np.random.PCG64(seed).random_raw(m) % np.uint64(n)
        values, first = _unique_first(draw)
        del draw
        if values.size >= k:
            cut = np.partition(first, k - 1)[k - 1]  # the k-th earliest first occurrence
            return values[first <= cut].astype(np.int64)
        m *= 2


def _unique_first(draw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(draw, return_index=True)`` (uint64 values below 2**32 when the fast path applies):
    the sorted distinct values and each one's first index. Fast path: one sort of the 64-bit keys
    ``value << 32 | index`` (numpy's vectorised sort, instead of unique's stable argsort); the first
    key of each value's run holds its first index."""
    if draw.size == 0 or draw.size >= 1 << 32 or int(draw.max()) >= 1 << 32:
        return np.unique(draw, return_index=True)
    keys = draw << np.uint64(32)
    keys |= np.arange(draw.size, dtype=np.uint64)
    keys.sort()
    vals = keys >> np.uint64(32)
    head = np.empty(keys.size, dtype=np.bool_)
    head[0] = True
    np.not_equal(vals[1:], vals[:-1], out=head[1:])
    first = (keys[head] & np.uint64(0xFFFFFFFF)).astype(np.intp)
    return vals[head], first


def _mask_chunks(mask: np.ndarray, vals: np.ndarray, factor: np.float32) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(positions, values * factor) of the kept entries, `_STEP` positions of the mask at a time."""
    done = 0
    for start in range(0, mask.size, _STEP):
        idx = np.flatnonzero(mask[start : start + _STEP])
        yield start + idx, vals[done : done + idx.size] * factor
        done += idx.size


def _position_chunks(pos: np.ndarray, vals: np.ndarray, factor: np.float32) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(positions, values * factor), `_STEP` entries at a time."""
    for start in range(0, pos.size, _STEP):
        yield pos[start : start + _STEP], vals[start : start + _STEP] * factor


def random_positions(seed: int, n: int, k: int) -> np.ndarray:
    """The k positions of `random_mask`, sorted ascending (int64, shape ``(k,)``).

    Very sparse selections (``k * _MASK_RATIO <= n``) never build the n-sized mask (O(k)
    memory); denser ones (n < 64 k, so O(n) is O(k)) read it from `random_mask`.
    """
    if 0 < k and k * _MASK_RATIO <= n:
        return _sparse_positions(seed, n, k)
    return np.flatnonzero(random_mask(seed, n, k)).astype(np.int64, copy=False)


def seeded_chunks(seed: int, n: int, k: int, vals: np.ndarray,
                  factor: float = 1.0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(positions, values * factor) pieces of the k positions ``seed`` names, in position order
    (what `ChunkedSparseDecoding` scatters).

    ``vals``: float32, shape ``(k,)``, the kept values in position order. Very sparse selections
    (``k * _MASK_RATIO <= n``) are regenerated as positions (O(k)), never as an n-byte mask.
    """
    factor = np.float32(factor)
    if k == 0 or k * _MASK_RATIO <= n:
        return _position_chunks(random_positions(seed, n, k) if k else np.zeros(0, np.int64), vals, factor)
    return _mask_chunks(random_mask(seed, n, k), vals, factor)


class SeededPositions:
    """Mixin of the codecs whose kept positions come from a per-call 64-bit seed that travels
    instead of the positions (``randomk``, ``randsign``).

    Parameters
    ----------
    density : float
        Fraction of entries kept, in (0, 1].
    seed : int, optional
        Seeds the per-call seeds (reproducible runs); None draws from the OS.

    Raises
    ------
    ValueError
        ``density`` outside (0, 1] or ``seed`` outside [0, 2**64).
    """

    def __init__(self, density: float = 0.01, seed: int | None = None) -> None:
        self.density = check_density(density)
        if seed is not None:
            check_range("seed", seed, 0, 2**64 - 1, integer=True)
        self.seed = seed
        self._seeds = np.random.default_rng(seed)

    def _draw_positions(self, flat: torch.Tensor) -> tuple[int, int, torch.Tensor]:
        """``(k, seed, positions)`` for a 1-D tensor: k = `k_for` (density, n), a fresh seed
        in [0, 2**63), its k sorted positions (int64 tensor on ``flat``'s device)."""
        n = flat.numel()
        k = k_for(self.density, n)
        seed = int(self._seeds.integers(0, 2**63))
        return k, seed, torch.from_numpy(random_positions(seed, n, k)).to(flat.device)


class RandomKCompressor(SeededPositions, ChunkedSparseDecoding, Compressor):
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
    options = (DENSITY,)
    sparse = True
    secagg = True
    seeded = True
    _PARAMS = "<QQf"  # k, seed, scale factor

    def __init__(self, density: float = 0.01, rescale: bool = False, seed: int | None = None) -> None:
        super().__init__(density, seed)
        self.rescale = bool(rescale)

    def error_feedback_refusal(self) -> str:
        """Non-empty with ``rescale=True`` at density <= 1/2: the rescaled estimate is unbiased with a variance of
        ``(1/density - 1) ||x||^2`` (k of n entries kept, each times n/k), at or above ``||x||^2`` there, and error
        feedback's residual grows without bound. Unscaled (the default) it keeps part of x and drops the rest."""
        if not self.rescale or self.density > 0.5:
            return ""
        return (f"randomk with rescale=True at density={self.density} is unbiased with a variance of "
                f"{1 / self.density - 1:.3g} x ||x||^2, and error feedback diverges from 1 x ||x||^2 on: keep rescale "
                f"off (the default) with error feedback")

    def config(self) -> dict:
        """``{"density": ..., "rescale": ...}``."""
        return {"density": self.density, "rescale": self.rescale}

    def _encode(self, flat: torch.Tensor) -> tuple[bytes, bytes]:
        n = flat.numel()
        k, seed, pos = self._draw_positions(flat)
        factor = (n / k) if (self.rescale and k) else 1.0
        vals = flat[pos].cpu().numpy()
        return struct.pack(self._PARAMS, k, seed, factor), vals.tobytes()

    @classmethod
    def _decode_chunks(cls, header: Header,
                       payload: memoryview) -> tuple[int, Iterator[tuple[np.ndarray, np.ndarray]]]:
        k, seed, factor = unpack_params(cls._PARAMS, header.params, cls.name)
        n = header.numel
        if k > n:
            raise PayloadError(f"randomk: k = {k} exceeds the tensor size {n}")
        if not np.isfinite(factor):
            raise PayloadError(f"randomk: scale factor {factor} is not finite")
        r = BodyReader(payload, header.body_offset, cls.name)
        vals = np.frombuffer(r.take(4 * k, "values"), dtype=np.float32)
        r.finish()
        return k, seeded_chunks(seed, n, k, vals, factor)
