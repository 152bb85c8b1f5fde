"""Stochastic rounding shared by ``qsgd`` and ``int8``: ``floor(v + U[0, 1))``, unbiased."""

from __future__ import annotations

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
