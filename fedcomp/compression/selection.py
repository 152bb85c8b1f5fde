"""Exact top-k selection by magnitude, fast on large tensors.

For large n and small k, ``torch.topk`` over the whole tensor is the slow step of top-k
and STC. Following the sampled-threshold idea of Deep Gradient Compression (Lin et al.,
ICLR 2018), a threshold t is estimated from a strided sample, one comparison pass keeps
the candidates with ``|x| >= t`` (numpy's ``flatnonzero`` on CPU, no ``|x|`` temporary),
and an exact ``torch.topk`` over the small candidate set fixes the count to exactly k.
If t was too high (fewer than k candidates), the function falls back to one exact
``torch.topk`` over everything, so the result is always the exact top-k set (ties
broken arbitrarily, as ``torch.topk`` does).
"""

from __future__ import annotations

import numpy as np
import torch

#: Below this many elements a plain ``torch.topk`` is used.
SAMPLED_MIN_NUMEL = 1 << 17
_SAMPLE = 1 << 14


def _candidates(flat: torch.Tensor, thr: float) -> torch.Tensor:
    if flat.device.type == "cpu":
        xn = flat.numpy()
        return torch.from_numpy(np.flatnonzero((xn >= thr) | (xn <= -thr)))
    return torch.nonzero(flat.abs() >= thr).squeeze(1)


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
            cand = _candidates(flat, thr).to(flat.device)
            if cand.numel() >= k:
                sel = torch.topk(flat[cand].abs(), k, sorted=False).indices
                return torch.sort(cand[sel]).values
    idx = torch.topk(flat.abs(), k, sorted=False).indices
    return torch.sort(idx).values
