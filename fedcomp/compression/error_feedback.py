"""Error feedback (residual memory) around any compressor.

Sources: Seide et al., "1-Bit Stochastic Gradient Descent", Interspeech 2014; Stich,
Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS 2018; Karimireddy et al.,
"Error Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML 2019.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from .base import Compressor, check_input, decompress, decompress_sparse

_RESIDUAL_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
#: Clients already warned about fp16 residual saturation (one warning each per process).
_SATURATION_WARNED: set = set()


def warn_saturation_once(client, saturated: float, lost_fraction: float) -> bool:
    """Log one warning per ``client`` the first time its fp16 residual saturates.

    Parameters
    ----------
    client : hashable
        Who compressed (a node id).
    saturated : float
        Residual entries clamped to ±65504 this round (:attr:`ErrorFeedback.last_saturated`,
        summed over payloads).
    lost_fraction : float
        Largest relative L2 norm of a payload's update the clamp dropped
        (:attr:`ErrorFeedback.last_saturated_loss`).

    Returns
    -------
    bool
        Whether a warning was logged (on Flower's ``flwr`` logger, like the rest of fedcomp).
    """
    if not saturated or client in _SATURATION_WARNED:
        return False
    _SATURATION_WARNED.add(client)
    logging.getLogger("flwr").warning(
        "fedcomp: client %s: the fp16 error-feedback residual saturated %d entries at +-65504, losing %.1f %% of "
        "the update (relative L2) for good (reported each round as 'residual-saturated'; warned once): use "
        "residual-dtype = \"fp32\" or smaller updates", client, int(saturated), 100.0 * lost_fraction)
    return True


def _segment_sq_norms(flat: torch.Tensor, sizes: list[int]) -> list[float]:
    """Squared L2 norms of consecutive segments of a float32 vector (fp32 reduction, float results)."""
    out, off = [], 0
    for n in sizes:
        out.append(float(torch.linalg.vector_norm(flat[off: off + n])) ** 2 if n else 0.0)
        off += n
    return out


class ErrorFeedback:
    """Compress ``x + e`` and keep what was lost: ``e <- (x + e) - decompress(sent)``.

    Over any sequence of calls the sends telescope: ``sum(decoded sends) + e_final ==
    sum(inputs)`` up to float32 rounding (exactly so with an fp32 residual, up to fp16
    rounding of e with ``residual_dtype="fp16"``). The residual is computed from the
    *decoded payload*, i.e. exactly what the receiver sees.

    Parameters
    ----------
    compressor : Compressor
        Any codec from :func:`fedcomp.compression.get_compressor`.
    residual_dtype : {"fp32", "fp16"}
        Storage of the residual; "fp16" halves its memory (4 -> 2 bytes/parameter) and
        saturates entries beyond ±65504.

    Attributes
    ----------
    residual : torch.Tensor or None
        Current residual, shape of the last input, on its device; None before the first call.
    last_error : float
        Relative L2 compression error ``||v - v_hat|| / ||v||`` of the last call (v = x + e).
    last_saturated : int
        Residual entries the last call clamped to ±65504 (``residual_dtype="fp16"``; else 0).
    last_saturated_loss : float
        What the clamp dropped in the last call, ``||max(|e| - 65504, 0)|| / ||v||`` (relative
        L2, like ``last_error``; 0.0 when nothing saturated): lost for good, never sent later.
    """

    def __init__(self, compressor: Compressor, residual_dtype: str = "fp32") -> None:
        if not isinstance(compressor, Compressor):
            raise TypeError(f"expected a Compressor, got {type(compressor).__name__}")
        if residual_dtype not in _RESIDUAL_DTYPES:
            raise ValueError(f"residual_dtype must be one of {sorted(_RESIDUAL_DTYPES)}, got {residual_dtype!r}")
        self.compressor = compressor
        self.residual_dtype = residual_dtype
        self.residual: torch.Tensor | None = None
        self.last_error = 0.0
        self.last_sq_error = 0.0
        self.last_sq_norm = 0.0
        self.last_segment_sq_norms: list[float] = []
        self.last_segment_sq_errors: list[float] = []
        self.last_saturated, self.last_saturated_loss = 0, 0.0

    def compress(self, x: torch.Tensor, *, inplace: bool = False, segments: list[int] | None = None) -> bytes:
        """Compress ``x`` plus the residual and update the residual.

        Parameters
        ----------
        x : torch.Tensor
            Any shape and supported float dtype; CPU or CUDA. Must keep the same shape
            across calls (call :meth:`reset` to change it).
        inplace : bool
            Allow overwriting a float32 ``x``: it becomes ``v = x + e`` and then the new
            residual, so the call needs no model-sized copy of its own. Default False.
        segments : list of int, optional
            Sizes of consecutive segments of the flattened ``x`` (summing to ``x.numel()``);
            their squared norms of ``v`` and of the error are then kept in
            :attr:`last_segment_sq_norms` / :attr:`last_segment_sq_errors` (per-layer
            monitoring without another pass by the caller).

        Returns
        -------
        bytes
            The payload of ``x + e``.

        Raises
        ------
        ValueError
            NaN/Inf in ``x`` or a shape different from the residual's; the residual is
            left unchanged.
        """
        check_input(x)
        if self.residual is not None and self.residual.shape != x.shape:
            raise ValueError(f"input shape {tuple(x.shape)} differs from the residual's {tuple(self.residual.shape)}")
        v = x.detach()
        if v.dtype != torch.float32 or not inplace:
            v = v.to(torch.float32, copy=True)
        if self.residual is not None:
            v += self.residual.to(device=v.device, dtype=torch.float32)
            if not bool(torch.isfinite(v.sum())) and not bool(torch.isfinite(v).all()):
                if self.residual is not None and inplace and x.dtype == torch.float32:
                    v -= self.residual.to(device=v.device, dtype=torch.float32)  # give x back as it was
                raise ValueError("input + residual overflows float32; residual left unchanged")
        flat = v.reshape(-1)
        sizes = [flat.numel()] if segments is None else list(segments)
        norms = _segment_sq_norms(flat, sizes)
        payload = self.compressor.compress(v)
        # The error v - v_hat, in place in v: O(k) for sparse payloads, one decode otherwise.
        sparse = decompress_sparse(payload, max_numel=max(v.numel(), 1))
        if sparse is not None:
            pos, vals = sparse
            flat[torch.from_numpy(pos).to(v.device)] -= torch.from_numpy(vals).to(v.device)
        else:
            v -= decompress(payload, max_numel=max(v.numel(), 1)).to(v.device)
        errors = _segment_sq_norms(flat, sizes)
        self.last_sq_error, self.last_sq_norm = float(sum(errors)), float(sum(norms))
        self.last_segment_sq_norms, self.last_segment_sq_errors = norms, errors
        self.last_error = (self.last_sq_error / self.last_sq_norm) ** 0.5 if self.last_sq_norm else 0.0
        if self.residual_dtype == "fp16":  # saturate: an Inf residual would poison every later round
            self._count_saturation(v)
            v = v.clamp_(-65504.0, 65504.0)
        self.residual = v.to(_RESIDUAL_DTYPES[self.residual_dtype])
        return payload

    def _count_saturation(self, err: torch.Tensor) -> None:
        """Entries of the new residual beyond ±65504 and the relative L2 norm the clamp drops."""
        self.last_saturated, self.last_saturated_loss = 0, 0.0
        lo, hi = torch.aminmax(err) if err.numel() else (torch.zeros(()), torch.zeros(()))
        if float(hi) <= 65504.0 and float(lo) >= -65504.0:  # the usual case: one pass, no temporary
            return
        over = (err.abs() - 65504.0).clamp_(min=0.0)
        self.last_saturated = int(torch.count_nonzero(over))
        self.last_saturated_loss = float(torch.linalg.vector_norm(over.double())) / self.last_sq_norm ** 0.5

    @property
    def residual_norm(self) -> float:
        """L2 norm of the residual (0.0 before the first call)."""
        return 0.0 if self.residual is None else float(torch.linalg.vector_norm(self.residual.double()))

    def get_residual(self, copy: bool = True) -> np.ndarray | None:
        """The residual as a numpy array (its storage dtype, CPU), or None; for saving.

        ``copy=False`` returns a view of a CPU residual (valid until the next :meth:`compress`).
        """
        if self.residual is None:
            return None
        out = self.residual.detach().cpu().numpy()
        return out.copy() if copy else out

    def set_residual(self, residual: np.ndarray | torch.Tensor | None, copy: bool = True) -> None:
        """Restore a residual saved with :meth:`get_residual` (or any array of the input shape).

        ``copy=False`` keeps a reference when the dtype already matches (the next :meth:`compress`
        only reads it, then replaces it), saving a model-sized copy.

        Raises
        ------
        ValueError
            If it holds NaN/Inf.
        """
        if residual is None:
            self.residual = None
            return
        t = torch.as_tensor(residual).detach().to(_RESIDUAL_DTYPES[self.residual_dtype])
        if t.numel() and not bool(torch.isfinite(t.sum())) and not bool(torch.isfinite(t).all()):
            raise ValueError("residual holds non-finite values")
        self.residual = t.clone() if copy else t

    def reset(self) -> None:
        """Forget the residual."""
        self.residual = None
