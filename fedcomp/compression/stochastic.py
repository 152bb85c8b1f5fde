"""Stochastic rounding shared by ``qsgd`` and ``int8``: ``floor(v + U[0, 1))``, unbiased."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

#: Fewest draws for which `StochasticRounder.uniform_chunks` draws ahead on a helper thread.
AHEAD_MIN = 1 << 20


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
        """The draws `round` of a tensor of ``shape`` would use, U[0, 1) i.i.d.: a caller
        that rounds that tensor piece by piece (bounded temporaries) computes ``floor(v + u)`` on
        matching slices and gets the same numbers."""
        return torch.rand(shape, generator=self._gen(device), device=device, dtype=dtype)

    def round_(self, v: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
        """`round` in place: ``v <- floor(v + u)``, the same values and the same draws.

        ``scratch``: at least ``v.numel()`` entries of v's dtype and device for u (allocated if
        omitted). The generator is read in order, so rounding a tensor chunk by chunk draws what
        one call on the whole tensor draws (CPU; a CUDA generator's stream depends on the shape).
        """
        if scratch is None:
            scratch = torch.empty(v.numel(), dtype=v.dtype, device=v.device)
        u = scratch[: v.numel()].view(v.shape)
        torch.rand(v.shape, generator=self._gen(v.device), out=u)
        return v.add_(u).floor_()

    def uniform_chunks(self, sizes: Sequence[int]) -> Iterator[np.ndarray]:
        """The next CPU draws, U[0, 1) float32, as consecutive numpy arrays of ``sizes`` entries: the
        numbers `round_` would add on CPU tensors of those sizes, in order.

        Above `AHEAD_MIN` draws in all, a helper thread draws the next chunk while the caller
        works on the current one (the Mersenne Twister behind ``torch.rand`` is sequential, and
        most of a stochastic-rounding encoder's time on the CPU): two buffers of the largest size
        alternate, so a yielded array is valid until the next one is requested. The generator
        ends up where one ``torch.rand`` of ``sum(sizes)`` entries leaves it, unless the caller
        stops early (then up to one chunk more has been drawn).
        """
        sizes = list(sizes)
        if not sizes:
            return
        gen = self._gen(torch.device("cpu"))
        bufs = [np.empty(max(sizes), dtype=np.float32) for _ in range(2)]
        views = [torch.from_numpy(b) for b in bufs]

        def draw(i: int) -> np.ndarray:
            torch.rand(sizes[i], generator=gen, out=views[i % 2][: sizes[i]])
            return bufs[i % 2][: sizes[i]]

        if sum(sizes) < AHEAD_MIN or len(sizes) == 1:
            for i in range(len(sizes)):
                yield draw(i)
            return
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedcomp-draws") as pool:
            pending = pool.submit(draw, 0)
            for i in range(len(sizes)):
                u = pending.result()
                if i + 1 < len(sizes):
                    pending = pool.submit(draw, i + 1)
                yield u
