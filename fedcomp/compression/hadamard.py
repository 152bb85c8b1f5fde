"""The randomised Hadamard rotation used by ``eden``: random signs, then a fast Walsh-Hadamard
transform (O(n log n), in place, vectorised in torch), on blocks whose sizes are powers of two.

Sources: Ailon & Chazelle, "The Fast Johnson-Lindenstrauss Transform", STOC 2006 (randomised
Hadamard); Vargaftik et al., "DRIVE: One-bit Distributed Mean Estimation", NeurIPS 2021.
"""

from __future__ import annotations

import numpy as np
import torch

from fedcomp.compression.chunked import spans


def fwht_(x: torch.Tensor, buf: torch.Tensor | None = None, zero_signs: bool = True) -> torch.Tensor:
    """Unnormalised fast Walsh-Hadamard transform of a 1-D tensor, in place: ``x <- H x``.

    H is the Sylvester Hadamard matrix (``H @ H = len(x) * I``); ``H / sqrt(len(x))`` is
    orthonormal and symmetric, so it is its own inverse.

    Each level h = 1, 2, 4, ... maps every pair ``(a, b)`` (h apart) to ``(a + b, -(b - a))``.
    On the CPU, from `BLOCKED_MIN` entries on, the levels run cache-blocked
    (`_fwht_blocked`): the same operations on every entry, so the same bits.

    Parameters
    ----------
    x : torch.Tensor
        1-D float tensor, contiguous, length a power of two (1 included); any device.
    buf : torch.Tensor, optional
        Scratch space of at least ``len(x) // 2`` entries (x's dtype and device), e.g. from a numpy
        array so that its memory is counted where numpy's is; allocated if omitted. Unused by the
        cache-blocked CPU path, whose scratch is three cache-sized tensors.
    zero_signs : bool
        True (default): the exact operations above, signed zeros included. False (CPU, cache-blocked
        path): ``-(b - a)`` is computed as ``a - b``, one operation less per level; the two differ
        only where ``a == b``, giving +0.0 instead of -0.0, so every entry is the same number and
        only the sign of a zero may differ (for callers that read ``|y|`` and ``y >= 0`` only).

    Returns
    -------
    torch.Tensor
        ``x`` itself. Extra memory: ``buf`` (``len(x) / 2`` entries), or on the cache-blocked path
        at most ``3 * 2**16`` entries.

    Raises
    ------
    ValueError
        If the length is not a power of two.
    """
    n = x.numel()
    if n & (n - 1):
        raise ValueError(f"fwht_: length {n} is not a power of two")
    if x.device.type == "cpu" and n >= BLOCKED_MIN and x.is_contiguous():
        return _fwht_blocked(x, zero_signs)
    if buf is None:
        buf = torch.empty(n // 2, dtype=x.dtype, device=x.device)
    h = 1
    while h < n:
        pairs = x.view(-1, 2, h)
        a, b = pairs[:, 0, :], pairs[:, 1, :]
        t = buf[: n // 2].view(a.shape).copy_(a)
        a.add_(b)
        b.sub_(t).neg_()  # b <- a_old - b_old
        h *= 2
    return x


#: From this length on, a CPU transform runs cache-blocked.
BLOCKED_MIN = 1 << 12
#: Entries per cache block of `_fwht_blocked` (256 KiB of float32).
_GROUP = 1 << 16
#: Levels below this pair distance run on a transposed copy of the block, as row operations.
_TRANSPOSE = 64


def _level(src: torch.Tensor, dst: torch.Tensor, h: int, inner: int = 1, zero_signs: bool = True) -> None:
    """One butterfly level from ``src`` into ``dst`` (same shape): entries ``h * inner`` apart
    pair up as ``(a, b) -> (a + b, -(b - a))``, the exact operations of the in-place loop (with
    ``zero_signs=False``: ``a - b``, the same but for the sign of a zero)."""
    s, d = src.view(-1, 2, h * inner), dst.view(-1, 2, h * inner)
    a, b, da, db = s[:, 0], s[:, 1], d[:, 0], d[:, 1]
    torch.add(a, b, out=da)
    if zero_signs:
        torch.sub(b, a, out=db)
        db.neg_()
    else:
        torch.sub(a, b, out=db)


def _levels(src: torch.Tensor, dst: torch.Tensor, count: int, inner: int, zero_signs: bool = True) -> torch.Tensor:
    """Levels h = 1, 2, .., count / 2 on entries ``h * inner`` apart, ping-ponged between ``src``
    and ``dst``; returns the one holding the result."""
    h = 1
    while h < count:
        _level(src, dst, h, inner, zero_signs)
        src, dst = dst, src
        h *= 2
    return src


def _fwht_blocked(x: torch.Tensor, zero_signs: bool = True) -> torch.Tensor:
    """`fwht_` on the CPU, cache-blocked, every entry's operations unchanged.

    With the length cut into R rows of G = `_GROUP` entries (``H_n = H_R (x) H_G``): each
    row gets its levels below `_TRANSPOSE` on a transposed copy (rows of G / T contiguous
    entries, so every operation is vectorised) and the rest in place; then column tiles of the
    R x G matrix, copied out so that they stay in cache, get the levels across rows. Scratch: three
    tensors of at most G entries.
    """
    n = x.numel()
    group = min(n, _GROUP)
    rows, t = n // group, min(_TRANSPOSE, group)
    cols = group // t
    s1, s2 = torch.empty(group, dtype=x.dtype), torch.empty(group, dtype=x.dtype)
    for r in range(rows):
        xg = x[r * group : (r + 1) * group]
        s1.view(t, cols).copy_(xg.view(cols, t).t())
        res = _levels(s1, s2, t, cols, zero_signs)  # pairs h apart in the row are transposed rows h apart
        xg.view(cols, t).copy_(res.view(t, cols).t())
        h = t
        src, dst = xg, s1
        while h < group:
            _level(src, dst, h, 1, zero_signs)
            src, dst = dst, src
            h *= 2
        if src is not xg:
            xg.copy_(src)
    if rows > 1:
        width = max(1, group // rows)
        tile1, tile2 = torch.empty(rows * width, dtype=x.dtype), torch.empty(rows * width, dtype=x.dtype)
        mat = x.view(rows, group)
        for c in range(0, group, width):
            w = min(width, group - c)
            a, b = tile1[: rows * w], tile2[: rows * w]
            a.view(rows, w).copy_(mat[:, c : c + w])
            mat[:, c : c + w].copy_(_levels(a, b, rows, w, zero_signs).view(rows, w))
    return x


def power_of_two_blocks(n: int) -> list[tuple[int, int]]:
    """Cut ``[0, n)`` into blocks whose sizes are the powers of two in n's binary expansion,
    largest first: ``1000 -> [(0, 512), (512, 256), (768, 128), (896, 64), (960, 32), (992, 8)]``.

    Returns
    -------
    list of (offset, size)
        At most ``n.bit_length()`` blocks; no padding is ever needed.
    """
    out, off = [], 0
    for bit in range(n.bit_length() - 1, -1, -1):
        if n >> bit & 1:
            out.append((off, 1 << bit))
            off += 1 << bit
    return out


def random_sign_bits(seed: int, n: int) -> np.ndarray:
    """The n random signs that ``seed`` names, as uint8 0/1 (1 = +1, 0 = -1), shape ``(n,)``.

    Uses only the raw output of numpy's PCG64 bit generator (``random_raw``), whose stream
    numpy keeps stable across releases, read little-endian: client and server agree.
    """
    return np.unpackbits(random_sign_bytes(seed, n), count=n, bitorder="little")


def random_sign_bytes(seed: int, n: int) -> np.ndarray:
    """`random_sign_bits` packed: uint8, ``8 * ceil(n / 64)`` bytes, bit i of the stream
    (little bit order) the sign of entry i."""
    return np.random.PCG64(seed).random_raw(-(-n // 64)).astype("<u8").view(np.uint8)


def flip_signs(src: np.ndarray, signs: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out = src`` negated where bit i of ``signs`` (packed, little bit order) is 0: the float32
    sign bit flipped (exactly IEEE negation, -0.0 included), in chunks of `CHUNK` entries.

    Parameters
    ----------
    src, out : np.ndarray
        float32, shape ``(n,)`` (``out`` may be ``src``).
    signs : np.ndarray
        uint8, at least ``ceil(n / 8)`` bytes.
    """
    n = src.size
    sv, ov = src.view(np.uint32), out.view(np.uint32)
    for start, stop in spans(n):
        flip = np.unpackbits(signs[start // 8 : -(-stop // 8)], count=stop - start, bitorder="little")
        flip ^= np.uint8(1)
        f = flip.astype(np.uint32)
        f <<= np.uint32(31)
        np.bitwise_xor(sv[start:stop], f, out=ov[start:stop])
    return out
