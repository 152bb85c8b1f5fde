"""Error feedback (residual memory) around any compressor.

Sources: Seide et al., "1-Bit Stochastic Gradient Descent", Interspeech 2014; Stich,
Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS 2018; Karimireddy et al.,
"Error Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML 2019.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from .base import Compressor, check_input, decompress

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
        Largest share of a payload's L1 update mass the clamp dropped
        (:attr:`ErrorFeedback.last_saturated_mass`).

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
        "the update mass for good (reported each round as 'residual-saturated'; warned once): use "
        "residual-dtype = \"fp32\" or smaller updates", client, int(saturated), 100.0 * lost_fraction)
    return True


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
    last_saturated_mass : float
        L1 mass the clamp dropped in the last call, ``sum(|e| - 65504)`` over those entries, as
        a fraction of ``||v||_1`` (0.0 when nothing saturated): lost for good, not sent later.
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
        self.last_saturated, self.last_saturated_mass = 0, 0.0

    def compress(self, x: torch.Tensor) -> bytes:
        """Compress ``x`` plus the residual and update the residual.

        Parameters
        ----------
        x : torch.Tensor
            Any shape and supported float dtype; CPU or CUDA. Must keep the same shape
            across calls (call :meth:`reset` to change it).

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
        v = x.detach().to(torch.float32)
        if self.residual is not None:
            if self.residual.shape != v.shape:
                raise ValueError(f"input shape {tuple(v.shape)} differs from the residual's {tuple(self.residual.shape)}")
            v = v + self.residual.to(device=v.device, dtype=torch.float32)
            if not bool(torch.isfinite(v.sum())) and not bool(torch.isfinite(v).all()):
                raise ValueError("input + residual overflows float32; residual left unchanged")
        payload = self.compressor.compress(v)
        v_hat = decompress(payload, max_numel=max(v.numel(), 1)).to(v.device)
        err = v - v_hat
        self.last_sq_error = float(torch.sum(err.double() ** 2))
        self.last_sq_norm = float(torch.sum(v.double() ** 2))
        self.last_error = (self.last_sq_error / self.last_sq_norm) ** 0.5 if self.last_sq_norm else 0.0
        if self.residual_dtype == "fp16":  # saturate: an Inf residual would poison every later round
            over = (err.abs() - 65504.0).clamp_(min=0.0)
            self.last_saturated = int(torch.count_nonzero(over))
            self.last_saturated_mass = (float(over.sum(dtype=torch.float64)) / float(v.abs().sum(dtype=torch.float64))
                                        if self.last_saturated else 0.0)
            err = err.clamp(-65504.0, 65504.0)
        self.residual = err.to(_RESIDUAL_DTYPES[self.residual_dtype])
        return payload

    @property
    def residual_norm(self) -> float:
        """L2 norm of the residual (0.0 before the first call)."""
        return 0.0 if self.residual is None else float(torch.linalg.vector_norm(self.residual.double()))

    def get_residual(self) -> np.ndarray | None:
        """The residual as a numpy array (its storage dtype, CPU), or None; for saving."""
        return None if self.residual is None else self.residual.detach().cpu().numpy().copy()

    def set_residual(self, residual: np.ndarray | torch.Tensor | None) -> None:
        """Restore a residual saved with :meth:`get_residual` (or any array of the input shape).

        Raises
        ------
        ValueError
            If it holds NaN/Inf.
        """
        if residual is None:
            self.residual = None
            return
        t = torch.as_tensor(residual).detach().to(_RESIDUAL_DTYPES[self.residual_dtype])
        if t.numel() and not bool(torch.isfinite(t).all()):
            raise ValueError("residual holds non-finite values")
        self.residual = t.clone()

    def reset(self) -> None:
        """Forget the residual."""
        self.residual = None
