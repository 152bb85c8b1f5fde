"""Averaging a compressed tensor across the ranks of a process group.

The one place where fedcomp payloads meet ``torch.distributed``: the DDP communication hook and the
outer synchronisation both call `average`. Two ways to aggregate, chosen by what the codec's
compressed form allows:

- **allreduce** for codecs whose compressed form sums linearly (``none``: fp32; ``fp16``): each rank
  casts, one allreduce sums, every rank divides by the world size;
- **all-gather of payloads** for every other codec (sign with its scale, STC, top-k, rand-k, EDEN,
  QSGD, int8, PowerSGD, ...): payload sizes differ per rank, so the sizes travel first (one int64 per
  rank), then the payloads padded to the largest; every rank decodes every payload with the validated
  decoder and sums them in rank order, so the ranks' results are bit-identical.

Bytes are counted as handed to the collectives (what each rank contributes), not from the codecs' own
figures.

A rank that cannot encode (NaN/Inf in its tensor) still takes part in every collective: it sends a
negative size and its error message in place of a payload, and every rank then raises
`CompressionError` naming the failing ranks, so no rank is left waiting in a collective.

Source: Agarwal et al., "On the Utility of Gradient Compression in Distributed Training Systems",
MLSys 2022 (all-gather for codecs that do not sum; allreduce where they do).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fedcomp.compression import Compressor, ErrorFeedback, decompress, decompress_sparse

#: codecs whose compressed form is summed by an allreduce in this dtype
ALLREDUCE_DTYPES = {"none": torch.float32, "fp16": torch.float16}


class CompressionError(ValueError):
    """Raised on every rank of the group when a rank could not encode its tensor, or when the allreduced
    sum holds NaN/Inf.

    Attributes
    ----------
    ranks : list of int
        The ranks that failed to encode (empty when only the allreduced sum shows it: then no single rank
        is known).
    """

    def __init__(self, message: str, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks = list(ranks or [])


@dataclass
class ByteCount:
    """Bytes this rank handed to ``torch.distributed`` collectives, and what fp32 allreduce would have.

    Attributes
    ----------
    sent : int
        Bytes of every tensor this rank contributed to a collective (sizes, padding included).
    dense : int
        Bytes of the fp32 tensors an uncompressed allreduce would have contributed (4 per entry).
    """

    sent: int = 0
    dense: int = 0

    @property
    def ratio(self) -> float:
        """``dense / sent`` (1.0 before anything was sent)."""
        return self.dense / self.sent if self.sent else 1.0


def allgather_bytes(payload: bytes, group: dist.ProcessGroup | None = None, *,
                    device: torch.device | str = "cpu", error: str | None = None) -> tuple[list[bytes], int]:
    """Gather every rank's bytes, in rank order.

    Parameters
    ----------
    payload : bytes
        This rank's bytes (any length, 0 included).
    group : ProcessGroup, optional
        Default: the default group.
    device : torch.device or str
        Where the collective's tensors live: ``"cpu"`` for gloo, this rank's CUDA device for NCCL.
    error : str, optional
        This rank failed: its message travels in place of ``payload`` (announced by a negative
        size) and every rank raises `CompressionError` after the same two collectives.

    Returns
    -------
    (payloads, sent)
        ``payloads[r]`` is rank r's bytes; ``sent`` the bytes this rank handed to the two
        collectives (8 for its size, then the payload padded to the largest).

    Raises
    ------
    CompressionError
        On every rank, when any rank passed ``error``; the message names each failing rank and its error.
    """
    world = dist.get_world_size(group)
    if error is not None:
        payload = error.encode("utf-8", "replace")
    size = torch.tensor([len(payload) if error is None else -1 - len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    signed = [int(s.item()) for s in sizes]
    lengths = [n if n >= 0 else -1 - n for n in signed]
    longest = max(lengths)
    buf = torch.zeros(longest, dtype=torch.uint8)
    if payload:
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    buf = buf.to(device)
    bufs = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    out = [bytes(b[:n].cpu().numpy().tobytes()) for b, n in zip(bufs, lengths)]
    failed = [r for r, n in enumerate(signed) if n < 0]
    if failed:
        why = "; ".join(f"rank {r}: {out[r].decode('utf-8', 'replace')}" for r in failed)
        raise CompressionError(f"{len(failed)} of {world} rank(s) could not encode their tensor ({why})", failed)
    return out, 8 + longest


def average(flat: torch.Tensor, compressor: Compressor, feedback: ErrorFeedback | None,
            group: dist.ProcessGroup | None = None, count: ByteCount | None = None) -> torch.Tensor:
    """The mean over the group's ranks of each rank's ``flat``, sent compressed.

    Parameters
    ----------
    flat : torch.Tensor
        Float tensor of any shape (fp32, fp16 or bf16; CPU or CUDA), this rank's contribution; not
        modified. Shaped codecs (PowerSGD) see its shape.
    compressor : Compressor
        The codec; ``none`` and ``fp16`` are summed by allreduce, every other by an all-gather of
        payloads.
    feedback : ErrorFeedback or None
        This rank's error feedback for this tensor (wrapping ``compressor``); None sends
        ``compressor.compress(flat)`` with no residual.
    group : ProcessGroup, optional
        Default: the default group.
    count : ByteCount, optional
        Incremented with the bytes this rank hands to the collectives and the fp32 bytes.

    Returns
    -------
    torch.Tensor
        The mean, float32, shape and device of ``flat``; identical on every rank (bit for bit).

    Raises
    ------
    CompressionError
        On every rank alike: a rank's codec refused its tensor (NaN/Inf; the message names the rank
        and the codec's error), or the allreduced sum of ``none``/``fp16`` holds NaN/Inf. The caller
        adds its context (which bucket). The collectives have run to the end on every rank, so the
        group stays usable.
    fedcomp.compression.PayloadError
        A rank sent a payload that does not decode to ``flat``'s shape.
    """
    world = dist.get_world_size(group)
    device = flat.device
    dense_dtype = ALLREDUCE_DTYPES.get(compressor.name)
    if dense_dtype is not None and feedback is None:
        # cast, divide, allreduce: the order of torch's allreduce and fp16_compress_hook, so the results match
        x = flat.detach().to(dense_dtype, copy=True)
        x.div_(world)
        dist.all_reduce(x, group=group)
        if count is not None:
            count.sent += x.numel() * x.element_size()
            count.dense += flat.numel() * 4
        # checked after the collective: every rank sees the same sum and raises alike (no rank left waiting)
        if x.numel() and not bool(torch.isfinite(x.sum())) and not bool(torch.isfinite(x).all()):
            bad = int((~torch.isfinite(x)).sum())
            raise CompressionError(f"{compressor.name}: the sum over the ranks holds {bad} NaN/Inf value(s)")
        return x.to(torch.float32)
    try:
        payload, error = (feedback.compress(flat) if feedback is not None else compressor.compress(flat)), None
    except ValueError as err:  # NaN/Inf: the other ranks must still hear from this one
        payload, error = b"", f"{compressor.name}: {err}"
    payloads, sent = allgather_bytes(payload, group, device=device, error=error)
    n, shape = flat.numel(), tuple(flat.shape)
    total = torch.zeros(n, dtype=torch.float32)
    for p in payloads:  # rank order, the same decoder on every rank: bit-identical sums
        sparse = decompress_sparse(p, max_numel=max(n, 1), expected_shape=shape)
        if sparse is None:
            total += decompress(p, max_numel=max(n, 1), expected_shape=shape).reshape(-1)
        else:  # k kept entries, distinct positions: O(k), and exact as adding the dense decode
            pos, vals = (a if a.flags.writeable else a.copy() for a in sparse)
            total.index_add_(0, torch.from_numpy(pos), torch.from_numpy(vals))
    total.div_(world)
    if count is not None:
        count.sent += sent
        count.dense += flat.numel() * 4
    return total.reshape(flat.shape).to(device)

