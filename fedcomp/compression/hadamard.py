"""The randomised Hadamard rotation used by ``eden``: random signs, then a fast Walsh-Hadamard
transform (O(n log n), in place, vectorised in torch), on blocks whose sizes are powers of two.

Sources: Ailon & Chazelle, "The Fast Johnson-Lindenstrauss Transform", STOC 2006 (randomised
Hadamard); Vargaftik et al., "DRIVE: One-bit Distributed Mean Estimation", NeurIPS 2021.
"""

from __future__ import annotations

import numpy as np
import torch


def fwht_(x: torch.Tensor, buf: torch.Tensor | None = None) -> torch.Tensor:
    """Unnormalised fast Walsh-Hadamard transform of a 1-D tensor, in place: ``x <- H x``.

    H is the Sylvester Hadamard matrix (``H @ H = len(x) * I``); ``H / sqrt(len(x))`` is
    orthonormal and symmetric, so it is its own inverse.

    Parameters
    ----------
    x : torch.Tensor
        1-D float tensor, contiguous, length a power of two (1 included); any device.
    buf : torch.Tensor, optional
        Scratch space of at least ``len(x) // 2`` entries (x's dtype and device), e.g. from a
        numpy array so that its memory is counted where numpy's is; allocated if omitted.

    Returns
    -------
    torch.Tensor
        ``x`` itself. Extra memory: the ``len(x) / 2`` entries of ``buf``.

    Raises
    ------
    ValueError
        If the length is not a power of two.
    """
    n = x.numel()
    if n & (n - 1):
        raise ValueError(f"fwht_: length {n} is not a power of two")
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
    words = np.random.PCG64(seed).random_raw(-(-n // 64)).astype("<u8")
    return np.unpackbits(words.view(np.uint8), count=n, bitorder="little")
