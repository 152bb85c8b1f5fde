"""Exact top-k selection by magnitude, fast on large tensors.

For large n and small k, ``torch.topk`` over the whole tensor is the slow step of top-k
and STC. Following the sampled-threshold idea of Deep Gradient Compression (Lin et al.,
ICLR 2018), a threshold is estimated from a strided sample, a single comparison pass
keeps the candidates above it, and an exact ``torch.topk`` over the (small) candidate
set fixes the count to exactly k. If the threshold was too high (fewer than k
candidates), the function falls back to one exact ``torch.topk`` over everything, so
the result is always the exact top-k set (ties broken arbitrarily, as ``torch.topk``).
"""

from __future__ import annotations

import torch

#: Below this many elements a plain ``torch.topk`` is used.
SAMPLED_MIN_NUMEL = 1 << 17
_SAMPLE = 1 << 14


def topk_indices(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of a 1-D tensor, sorted ascending.

    Parameters
    ----------
    magnitude : torch.Tensor
        1-D float tensor (typically ``x.abs()``), shape ``(n,)``, finite, any device.
    k : int
        ``1 <= k <= n``.

    Returns
    -------
    torch.Tensor
        int64 tensor of shape ``(k,)`` on ``magnitude.device``, strictly increasing.
    """
    n = magnitude.numel()
    if k >= n:
        return torch.arange(n, device=magnitude.device)
    if n >= SAMPLED_MIN_NUMEL and k * 16 <= n:
        stride = max(n // _SAMPLE, 1)
        sample = magnitude[::stride]
        # Aim for ~2k candidates: the sample quantile at 1 - 2k/n (at least 2 sample points above).
        above = max(int(sample.numel() * 2 * k / n), 2)
        thr = torch.topk(sample, min(above, sample.numel())).values[-1]
        cand = torch.nonzero(magnitude >= thr).squeeze(1)
        if cand.numel() >= k:
            sel = torch.topk(magnitude[cand], k, sorted=False).indices
            return torch.sort(cand[sel]).values
    idx = torch.topk(magnitude, k, sorted=False).indices
    return torch.sort(idx).values
