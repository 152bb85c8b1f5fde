"""Exact top-k selection by magnitude, fast on large tensors.

For large n and small k, ``torch.topk`` over the whole tensor is the slow step of top-k
and STC. Following the sampled-threshold idea of Deep Gradient Compression (Lin et al.,
ICLR 2018), a threshold t is estimated from a strided sample, one comparison pass keeps
the candidates with ``|x| >= t``, and an exact selection over the small candidate set
fixes the count to exactly k. If t was too high (fewer than k candidates), the function
falls back to one exact ``torch.topk`` over everything, so the result is always the exact
top-k set.

On CPU the comparison pass runs over cache-sized chunks into two reused buffers (no
model-sized temporary: a fresh one costs a page fault per 4 KiB), and the exact step is
``np.partition`` over the candidates, whose positions come out of the pass already sorted,
so no sort follows. A tie at the k-th magnitude that not all tied entries fit, and other
devices, take ``torch.topk`` over the candidates (ties broken as ``torch.topk`` breaks them).
"""

from __future__ import annotations

import numpy as np
import torch

#: Below this many elements a plain ``torch.topk`` is used.
SAMPLED_MIN_NUMEL = 1 << 17
_SAMPLE = 1 << 14


#: Elements compared per step of the CPU candidate pass (two reused buffers of this size).
CHUNK = 1 << 16


def _candidates(flat: torch.Tensor, thr: float) -> torch.Tensor:
    """Sorted int64 positions of the entries with ``|x| >= thr`` (``thr > 0``; ``flat`` finite)."""
    if flat.device.type != "cpu":
        return torch.nonzero(flat.abs() >= thr).squeeze(1)
    xn = flat.numpy()
    mag = np.empty(min(CHUNK, xn.size), dtype=np.float32)
    hit = np.empty(mag.size, dtype=np.bool_)
    parts = []
    for start in range(0, xn.size, CHUNK):
        chunk = xn[start : start + CHUNK]
        a, m = mag[: chunk.size], hit[: chunk.size]
        np.greater_equal(np.abs(chunk, out=a), thr, out=m)
        i = np.flatnonzero(m)
        if i.size:
            i += start
            parts.append(i)
    return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))


def _top_k_of_candidates(flat: torch.Tensor, cand: torch.Tensor, k: int) -> torch.Tensor:
    """The k candidates of largest magnitude, in ascending position order (``cand`` sorted, holding
    at least k positions).

    CPU: one ``np.partition`` finds the k-th largest magnitude; every candidate above it is kept,
    already in position order. When several candidates share that magnitude and only some of
    them fit (a tie at the boundary, common in fp16 updates), the choice is ``torch.topk``'s over
    the candidates, as on other devices, so every payload is the same as ``torch.topk`` gives.
    """
    if flat.device.type == "cpu":
        pos = cand.numpy()
        mags = np.abs(flat.numpy()[pos])
        kth = np.partition(mags, mags.size - k)[mags.size - k]  # the k-th largest magnitude
        keep = mags >= kth
        if int(np.count_nonzero(keep)) == k:  # no tie straddles the boundary: the top k, in position order
            return torch.from_numpy(pos[keep])
    sel = torch.topk(flat[cand].abs(), k, sorted=False).indices
    return torch.sort(cand[sel]).values


def topk_indices(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k entries of largest magnitude of a 1-D tensor, sorted ascending.

    Parameters
    ----------
    flat : torch.Tensor
        1-D float32 tensor, shape ``(n,)``, finite, any device.
    k : int
        ``1 <= k <= n``.

    Returns
    -------
    torch.Tensor
        int64 tensor of shape ``(k,)`` on ``flat.device``, strictly increasing.
    """
    n = flat.numel()
    if k >= n:
        return torch.arange(n, device=flat.device)
    if n >= SAMPLED_MIN_NUMEL and k * 16 <= n:
        stride = max(n // _SAMPLE, 1)
        sample = flat[::stride].abs()
        # Aim for ~2k candidates: the sample quantile at 1 - 2k/n (at least 2 sample points above).
        above = max(int(sample.numel() * 2 * k / n), 2)
        thr = float(torch.topk(sample, min(above, sample.numel())).values[-1])
        if thr > 0:
            cand = _candidates(flat, thr)
            if cand.numel() >= k:
                return _top_k_of_candidates(flat, cand, k)
    idx = torch.topk(flat.abs(), k, sorted=False).indices
    return torch.sort(idx).values
