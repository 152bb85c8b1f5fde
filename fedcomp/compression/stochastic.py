"""Stochastic rounding shared by ``qsgd`` and ``int8``: ``floor(v + U[0, 1))``, unbiased."""

from __future__ import annotations

import numpy as np
import torch


class StochasticRounder:
    """Holds one ``torch.Generator`` per device, seeded from ``seed``.

    Parameters
    ----------
    seed : int, optional
        None seeds from the OS (``Generator.seed()``).
    """

    def __init__(self, seed: int | None) -> None:
        self.seed = seed
        self._gens: dict[str, torch.Generator] = {}

    def _gen(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._gens:
            g = torch.Generator(device=device)
            if self.seed is None:
                g.seed()
            else:
                g.manual_seed(int(self.seed))
            self._gens[key] = g
        return self._gens[key]

    def round(self, v: torch.Tensor) -> torch.Tensor:
        """``floor(v + u)``, u ~ U[0, 1) i.i.d.; float32 in, float32 out, same device.

        ``E[floor(v + u)] = v`` for every real v (unbiased).
        """
        return torch.floor(v + self.uniform(v.shape, v.device, v.dtype))

    def uniform(self, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The draws :meth:`round` of a tensor of ``shape`` would use, U[0, 1) i.i.d.: a caller
        that rounds that tensor piece by piece (bounded temporaries) computes ``floor(v + u)`` on
        matching slices and gets the same numbers."""
        return torch.rand(shape, generator=self._gen(device), device=device, dtype=dtype)

    def round_(self, v: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`round` in place: ``v <- floor(v + u)``, the same values and the same draws.

        ``scratch``: at least ``v.numel()`` entries of v's dtype and device for u (allocated if
        omitted). The generator is read in order, so rounding a tensor chunk by chunk draws what
        one call on the whole tensor draws (CPU; a CUDA generator's stream depends on the shape).
        """
        if scratch is None:
            scratch = torch.empty(v.numel(), dtype=v.dtype, device=v.device)
        u = scratch[: v.numel()].view(v.shape)
        torch.rand(v.shape, generator=self._gen(v.device), out=u)
        return v.add_(u).floor_()

    def uniform_into(self, out: np.ndarray) -> np.ndarray:
        """Fill the float32 numpy array ``out`` with the next ``out.size`` CPU draws, U[0, 1) (the
        numbers :meth:`round_` would add on a CPU tensor of that size); returns ``out``."""
        torch.rand(out.size, generator=self._gen(torch.device("cpu")), out=torch.from_numpy(out.reshape(-1)))
        return out
