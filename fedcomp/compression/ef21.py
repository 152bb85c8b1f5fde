"""EF21: error feedback by compressing the change of a shared estimate (client side).

Source: Richtárik, Sokolov, Fatkhullin, "EF21: A New, Simpler, Theoretically Better, and
Practically Faster Error Feedback", NeurIPS 2021 (Algorithm 1, with the client's round update in
place of its gradient, as in federated EF21 variants).

Each client i keeps an estimate ``h_i`` of its update; the server keeps ``h = mean_i h_i``.
Per round the client sends ``c_i = C(x_i - h_i)`` and both sides add the decoded ``c_i``:
``h_i <- h_i + c_i`` on the client, ``h <- h + mean_i c_i`` on the server
(`fedcomp.strategies.ef21_aggregate.EF21Aggregate`), and the server applies ``h`` as the round's
update. Classic error feedback ([`ErrorFeedback`][fedcomp.compression.ErrorFeedback]) sends ``C(x + e)``
and applies only what was sent; EF21 applies the running estimate, whose error shrinks as
``h_i`` follows ``x_i``, which the paper shows is what classic EF lacks on heterogeneous clients.

Invariant (tested): after any rounds, ``h_i == sum of decoded sends`` (the client's estimate is
exactly what the server has received from it; fp32 rounding).
"""

from __future__ import annotations

import torch

from fedcomp.compression.base import check_input
from fedcomp.compression.decoding import decompress, decompress_sparse
from fedcomp.compression.error_feedback import ErrorFeedback, segment_sq_norms


class EF21(ErrorFeedback):
    """Send ``C(x - h)`` and move the estimate: ``h <- h + decompress(sent)``.

    Same interface and saved state as [`ErrorFeedback`][fedcomp.compression.ErrorFeedback] (``h`` is
    stored where the residual is: `residual`, ``get_state()["residual"]``), so a client's
    state, its persistence and its regrouping across payload plans work unchanged. No momentum
    correction (DGC's rule is defined on a residual, not on an estimate).

    Parameters
    ----------
    compressor : Compressor
        Any codec from [`fedcomp.compression.get_compressor`][].
    residual_dtype : {"fp32", "fp16"}
        Storage of ``h`` ("fp16" saturates at ±65504; the server's ``h`` then differs by the clamp).

    Attributes
    ----------
    residual : torch.Tensor or None
        The estimate ``h`` (shape of the input), None before the first call.
    last_error : float
        ``||v - C(v)|| / ||v||`` with ``v = x - h`` (the error of this round's correction).
    """

    def __init__(self, compressor, residual_dtype: str = "fp32") -> None:
        super().__init__(compressor, residual_dtype=residual_dtype, momentum=0.0)

    def compress(self, x: torch.Tensor, *, inplace: bool = False, segments: list[int] | None = None,
                 finite: bool = False) -> bytes:
        """Compress ``x - h`` and add what the receiver decodes to ``h``.

        Parameters
        ----------
        x : torch.Tensor
            The round's update, any shape and float dtype; the same shape every call.
        inplace : bool
            Allow overwriting a float32 ``x`` (it becomes ``x - h``, then the error of the send).
        segments : list of int, optional
            Segment sizes for per-layer norms (see
            [`ErrorFeedback.compress`][fedcomp.compression.ErrorFeedback.compress]).
        finite : bool
            The caller has proven ``x`` a finite float32 tensor: its check is not repeated here.

        Returns
        -------
        bytes
            The payload of ``x - h``.

        Raises
        ------
        ValueError
            NaN/Inf in ``x``, or a shape other than ``h``'s; ``h`` is left unchanged.
        """
        if not finite:
            check_input(x)
        if self.residual is not None and self.residual.shape != x.shape:
            raise ValueError(f"input shape {tuple(x.shape)} differs from the estimate's {tuple(self.residual.shape)}")
        v = x.detach()
        if not (v.dtype == torch.float32 and inplace and v.is_contiguous()):  # row-major: v and h are viewed flat
            v = v.to(torch.float32, copy=True, memory_format=torch.contiguous_format)
        h = (torch.zeros_like(v) if self.residual is None
             else self.residual.to(device=v.device, dtype=torch.float32, copy=True,
                                   memory_format=torch.contiguous_format))
        v -= h
        flat = v.view(-1)
        sizes = [flat.numel()] if segments is None else list(segments)
        norms = segment_sq_norms(flat, sizes)
        payload = self.compressor.compress(v)
        hflat = h.view(-1)
        sparse = decompress_sparse(payload, max_numel=max(v.numel(), 1))
        if sparse is not None:
            pos, vals = (torch.from_numpy(a).to(v.device) for a in sparse)
            flat[pos] -= vals
            hflat[pos] += vals
        else:
            c_hat = decompress(payload, max_numel=max(v.numel(), 1)).to(v.device).reshape(-1)
            flat -= c_hat
            hflat += c_hat
        errors = segment_sq_norms(flat, sizes)
        self.last_sq_error, self.last_sq_norm = float(sum(errors)), float(sum(norms))
        self.last_segment_sq_norms, self.last_segment_sq_errors = norms, errors
        self.last_error = (self.last_sq_error / self.last_sq_norm) ** 0.5 if self.last_sq_norm else 0.0
        self.last_saturated, self.last_saturated_loss = 0, 0.0
        if self.residual_dtype == "fp16":
            self._count_saturation(h)
            h = h.clamp_(-65504.0, 65504.0).to(torch.float16)
        self.residual = h
        return payload


__all__ = ["EF21"]
