"""Exact top-k selection by magnitude, fast on large tensors.

For large n and small k, ``torch.topk`` over the whole tensor is the slow step of top-k
and STC. Following the sampled-threshold idea of Deep Gradient Compression (Lin et al.,
ICLR 2018), a threshold t is estimated from a strided sample, one comparison pass keeps
the candidates with ``|x| >= t``, and an exact selection over the small candidate set
fixes the count to exactly k. If t was too high (fewer than k candidates), a lower threshold
is tried once on the CPU, and then one exact ``torch.topk`` over everything, so the result is
always the exact top-k set.

On CPU the comparison pass runs over cache-sized chunks into two reused buffers (no
model-sized temporary: a fresh one costs a page fault per 4 KiB), taking each chunk's candidate
values while it is in cache, and the exact step is ``np.partition`` over the candidates, whose
positions come out of the pass already sorted, so no sort and no second gather follow. A tie
at the k-th magnitude that not all tied entries fit, and other devices, take ``torch.topk`` over
the candidates (ties broken as ``torch.topk`` breaks them).
"""

from __future__ import annotations

import numpy as np
import torch

#: Below this many elements a plain ``torch.topk`` is used.
SAMPLED_MIN_NUMEL = 1 << 17
_SAMPLE = 1 << 14


#: Elements compared per step of the CPU candidate pass (two reused buffers of this size).
CHUNK = 1 << 16
#: A refined threshold aims at this many times more candidates than the first one.
_REFINE = 8


def _candidates(flat: torch.Tensor, thr: float) -> tuple[np.ndarray, np.ndarray]:
    """Sorted int64 positions and the float32 values of the entries with ``|x| >= thr`` (``thr > 0``;
    ``flat`` a finite CPU tensor); each chunk's values are taken while it is in cache."""
    xn = flat.numpy()
    mag = np.empty(min(CHUNK, xn.size), dtype=np.float32)
    hit = np.empty(mag.size, dtype=np.bool_)
    parts, values = [], []
    for start in range(0, xn.size, CHUNK):
        chunk = xn[start : start + CHUNK]
        a, m = mag[: chunk.size], hit[: chunk.size]
        np.greater_equal(np.abs(chunk, out=a), thr, out=m)
        i = m.nonzero()[0]
        if i.size:
            values.append(chunk[i])
            i += start
            parts.append(i)
    if not parts:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
    return np.concatenate(parts), np.concatenate(values)


def _top_k_of_candidates(pos: np.ndarray, vals: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The k candidates of largest magnitude, positions ascending, with their values (``pos`` sorted,
    at least k of them); None when several candidates share the k-th magnitude and only some fit.

    One ``np.partition`` finds the k-th largest magnitude; every candidate at or above it is kept,
    already in position order.
    """
    mags = np.abs(vals)
    kth = np.partition(mags, mags.size - k)[mags.size - k]  # the k-th largest magnitude
    keep = mags >= kth
    if int(np.count_nonzero(keep)) != k:
        return None
    return pos[keep], vals[keep]


def _torch_topk(flat: torch.Tensor, cand: torch.Tensor | None, k: int) -> torch.Tensor:
    """``torch.topk``'s choice of k positions (over the candidates ``cand`` if given), sorted."""
    if cand is None:
        return torch.sort(torch.topk(flat.abs(), k, sorted=False).indices).values
    sel = torch.topk(flat[cand].abs(), k, sorted=False).indices
    return torch.sort(cand[sel]).values


def top_k(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and values of the k entries of largest magnitude of a 1-D tensor, positions sorted.

    The sampled threshold of Deep Gradient Compression (Lin et al., ICLR 2018): the threshold
    aims at about 2k candidates; when fewer than k pass (a skewed sample), it is refined once
    (aiming at 8 times more) before a full ``torch.topk``. Whenever the k-th magnitude is not
    shared by entries left out, the k largest are one set, found exactly by any candidate set
    that holds them; a tie at the boundary is broken by ``torch.topk`` over the first candidate
    set, or over the whole tensor after a refinement (what the selection always did).

    Parameters
    ----------
    flat : torch.Tensor
        1-D float32 tensor, shape ``(n,)``, finite, any device.
    k : int
        ``1 <= k <= n``.

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        int64 positions of shape ``(k,)``, strictly increasing, and ``flat`` at them (float32,
        ``(k,)``), both on ``flat.device``.
    """
    n = flat.numel()
    if k >= n:
        idx = torch.arange(n, device=flat.device)
        return idx, flat[idx]
    if n >= SAMPLED_MIN_NUMEL and k * 16 <= n:
        stride = max(n // _SAMPLE, 1)
        sample = flat[::stride].abs()
        for attempt, aim in enumerate((2, 2 * _REFINE)):
            # ~aim * k candidates: the sample quantile at 1 - aim * k / n (at least 2 sample points above)
            above = max(int(sample.numel() * aim * k / n), 2)
            if above >= sample.numel():
                break
            thr = float(torch.topk(sample, above).values[-1])
            if thr <= 0:
                break
            if flat.device.type != "cpu":  # one attempt: torch.topk over the candidates
                cand = torch.nonzero(flat.abs() >= thr).squeeze(1)
                if cand.numel() < k:
                    break
                idx = _torch_topk(flat, cand, k)
                return idx, flat[idx]
            pos, vals = _candidates(flat, thr)
            if pos.size < k:
                continue
            found = _top_k_of_candidates(pos, vals, k)
            if found is not None:
                return torch.from_numpy(found[0]), torch.from_numpy(found[1])
            if attempt == 0:  # a tie straddles the boundary: torch.topk's choice among these candidates
                idx = _torch_topk(flat, torch.from_numpy(pos), k)
                return idx, flat[idx]
            break
    idx = _torch_topk(flat, None, k)
    return idx, flat[idx]


def topk_indices(flat: torch.Tensor, k: int) -> torch.Tensor:
    """`top_k`'s positions alone: int64, shape ``(k,)``, strictly increasing, on ``flat.device``
    (``flat``: 1-D float32, finite; ``1 <= k <= n``)."""
    return top_k(flat, k)[0]
