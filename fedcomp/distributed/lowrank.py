"""PowerSGD in the DDP hook as the paper runs it: two allreduces per bucket, of P and of Q.

PowerSGD's factors sum linearly: with the same Q on every rank, ``mean_i(M_i Q) = mean_i(M_i) Q``. So a
bucket needs no all-gather of payloads: every rank forms ``P_i = M_i Q`` for each matrix of the bucket
(``M_i``: its gradient plus its residual), one allreduce averages every P of the bucket (the vectors and
small matrices, for which low rank does not pay, ride in the same allreduce, uncompressed), every rank
orthonormalises the mean P alike, forms ``Q_i = M_i^T P``, and a second allreduce averages the Qs. The
bucket's mean gradient is ``P Q^T`` for each matrix, bit-identical on every rank (the same P and Q);
each rank keeps ``M_i - P Q^T`` as its residual and the mean Q as the next step's warm start. Per rank
and step the bucket costs ``4 * r * (rows + columns)`` bytes for each matrix (2 with the codec's
``value_dtype="fp16"``, which both allreduces then use), whatever the world size, in two collectives (an
all-gather of payloads would take two per parameter, and each rank would decode every rank's). With fp16 factors
the small tensors go exact, in fp32, by a third allreduce, as torch's hook sends them: they have no error
feedback to carry an fp16 rounding.

The memory is the codec's own: per parameter an `fedcomp.compression.ErrorFeedback` holding the residual
and the warm-start Q (``"powersgd/q"``), saved and restored by `CompressionState.state_dict` as
before. The first Q of a parameter is drawn from a seed of ``(seed, parameter key)``, the same on every
rank (the paper's shared initialisation).

Source: Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019, Algorithm 1 (allreduce of P and Q, warm start) and Algorithm 2 (error
feedback).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from fedcomp.compression.powersgd import matrix_shape, orthogonalize, pow2_scale
from fedcomp.distributed.exchange import ByteCount, CompressionError

#: Codecs the hook runs through `powersgd_allreduce` instead of an all-gather of payloads.
ALLREDUCE_LOW_RANK = frozenset({"powersgd"})


def _first_q(seed: int, key: str, n: int, r: int) -> torch.Tensor:
    """A parameter's first Q, float32 ``(n, r)``: standard normal from ``(seed, key)``, equal on every rank."""
    salt = [int(x) for x in key.split(".")]
    gen = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, 7, *salt]).generate_state(1, np.uint64)[0]
                                            >> 1))
    return torch.randn(n, r, generator=gen)


def _allreduce_mean(x: torch.Tensor, world: int, wire: torch.dtype, group, count: ByteCount,
                    what: str) -> torch.Tensor:
    """The mean of ``x`` over the ranks, sent in ``wire`` (float32, or float16 for ``value_dtype="fp16"``),
    returned float32; the same on every rank, checked finite on every rank alike."""
    x = x.div_(world).to(wire)
    dist.all_reduce(x, group=group)
    count.sent += x.numel() * x.element_size()
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise CompressionError(f"powersgd: {what} hold {int((~torch.isfinite(x)).sum())} NaN/Inf value(s)")
    return x.to(torch.float32)


def powersgd_allreduce(state, grads: list[torch.Tensor], keys: list[str], group: dist.ProcessGroup | None,
                       count: ByteCount) -> torch.Tensor:
    """The mean over the ranks of a bucket's gradients, its matrices by rank-r PowerSGD.

    Parameters
    ----------
    state : CompressionState
        Its ``template`` (the PowerSGD codec: ``rank``, ``min_compression_rate``, ``uses_low_rank``),
        ``seed`` and per-parameter error feedback (``tensor_feedback``).
    grads : list of torch.Tensor
        This rank's gradients of the bucket's parameters, in bucket order (any float dtype and shape;
        summed over the rank's micro-batches, not divided by the world size).
    keys : list of str
        The parameters' keys, in the same order.
    group : ProcessGroup or None
        The group to average over.
    count : ByteCount
        Incremented with the bytes handed to the two allreduces and the fp32 bytes.

    Returns
    -------
    torch.Tensor
        float32, the bucket's flat mean (its entries in bucket order), identical on every rank.

    Raises
    ------
    CompressionError
        On every rank alike: NaN/Inf in the first allreduced vector (a rank's gradient or residual held
        NaN/Inf, or the sum overflowed), before the second allreduce.
    """
    world = dist.get_world_size(group)
    codec = state.template
    wire = torch.float16 if codec.value_dtype == "fp16" else torch.float32
    device = grads[0].device if grads else torch.device("cpu")
    low, dense = [], []  # (i, key, M, Q) / i
    for i, (key, g) in enumerate(zip(keys, grads)):
        if codec.uses_low_rank(tuple(g.shape)):
            m, n = matrix_shape(tuple(g.shape))
            ef = state.tensor_feedback(key)
            mat = g.detach().reshape(m, n).to(torch.float32, copy=True)
            if ef is not None and ef.residual is not None and ef.residual.numel() == mat.numel():
                mat += ef.residual.to(device).reshape(m, n)
            r = min(codec.rank, m, n)
            q = ef.compressor.q if ef is not None else None
            if q is None or tuple(q.shape) != (n, r):
                q = _first_q(state.seed, key, n, r)
            else:  # the last mean Q is as large as M: P = M Q would grow as M squared (past fp16 on the wire)
                q = q / pow2_scale(q)  # the same on every rank, exact
            q = q.to(device)
            low.append((i, key, mat, q))
        else:
            dense.append(i)
    # 1: the Ps and the uncompressed tensors, averaged by one allreduce (with fp16 factors the uncompressed
    # tensors go exact, in fp32, by an allreduce of their own: they have no error feedback to carry a rounding)
    smalls = [grads[i].detach().reshape(-1).to(torch.float32) for i in dense]
    exact = None
    if wire != torch.float32 and smalls:
        exact = _allreduce_mean(torch.cat(smalls), world, torch.float32, group, count, "the averaged small tensors")
        smalls = []
    first = torch.cat([(mat @ q).reshape(-1) for _, _, mat, q in low] + smalls + [torch.zeros(0, device=device)])
    if first.numel() or exact is None:  # the same on every rank: the bucket's structure decides
        first = _allreduce_mean(first, world, wire, group, count, "the averaged P and small tensors")
    ps, off = [], 0
    for _, _, mat, q in low:
        p = first[off: off + mat.shape[0] * q.shape[1]].reshape(mat.shape[0], q.shape[1]).clone()
        ps.append(orthogonalize(p))
        off += p.numel()
    # 2: the Qs, averaged by a second allreduce
    second = torch.cat([(mat.T @ p).reshape(-1) for (_, _, mat, _), p in zip(low, ps)]
                       + [torch.zeros(0, device=device)])
    if low:
        second = _allreduce_mean(second, world, wire, group, count, "the averaged Q")
    out = [None] * len(grads)
    qoff = 0
    for (i, key, mat, q), p in zip(low, ps):
        q_mean = second[qoff: qoff + q.numel()].reshape(q.shape).clone()
        qoff += q.numel()
        approx = p @ q_mean.T
        ef = state.tensor_feedback(key)
        if ef is not None:
            ef.residual = (mat - approx).reshape(grads[i].shape)
            ef.compressor.q = q_mean
        out[i] = approx.reshape(-1)
    source, off = (first, off) if exact is None else (exact, 0)  # where the small tensors' means are
    for i in dense:
        out[i] = source[off: off + grads[i].numel()]
        off += grads[i].numel()
    count.dense += 4 * sum(g.numel() for g in grads)
    return torch.cat([o for o in out] + [torch.zeros(0, device=device)])


__all__ = ["ALLREDUCE_LOW_RANK", "powersgd_allreduce"]
