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
        u = torch.rand(v.shape, generator=self._gen(v.device), device=v.device, dtype=v.dtype)
        return torch.floor(v + u)
