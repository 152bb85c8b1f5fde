"""The k positions and the optional rotation that every client of a round shares (Flower-free).

Every client of a round derives the same k positions (shared-seed random-k) and, optionally,
the same randomised Hadamard rotation from one per-round seed that the server sends. The encoding
``x -> (R x)[positions]`` is linear and identical across clients, so the sum of the encoded vectors
is the encoding of the sum: it survives secure aggregation's masked summation
(`fedcomp.secagg`), and the k summed values describe the round's update to anyone who knows the
seed (`fedcomp.download.shared_step`: the download of that update).

Sources: Stich, Cordonnier, Jaggi, NeurIPS 2018 (rand-k with memory); Konečný et al. 2016
(shared random masks); Chen, Choquette-Choo, Kairouz, Suresh, ICML 2022 (shared-randomness
linear compression under SecAgg); Ailon & Chazelle, STOC 2006 (randomised Hadamard).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from fedcomp.compression.hadamard import fwht_, power_of_two_blocks, random_sign_bits
from fedcomp.compression.randomk import random_mask
from fedcomp.compression.sparse import k_for


def derived_seed(round_seed: int, purpose: str) -> int:
    """A 63-bit seed for one purpose ("positions", "rotation") from the round's shared seed."""
    digest = hashlib.sha256(f"fedcomp-secagg:{purpose}:{int(round_seed)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def round_seed(run_seed: int, server_round: int) -> int:
    """The per-round shared seed the server sends (not a secret: it only names positions/rotation)."""
    return derived_seed(run_seed * 1_000_003 + server_round, "round")


@dataclass(frozen=True)
class SharedProjection:
    """The k positions and optional rotation that every client of one round shares.

    Parameters
    ----------
    dim : int
        d, the number of float entries of the flattened update (>= 1).
    density : float
        Fraction of entries kept, in (0, 1]; ``k = clamp(round(density * d), 1, d)``.
    seed : int
        The round's shared seed (>= 0).
    rotate : bool
        Apply the randomised Hadamard rotation (random signs, then an orthonormal Walsh-Hadamard
        transform on the power-of-two blocks of d) before selecting.
    """

    dim: int
    density: float
    seed: int
    rotate: bool = False

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise ValueError(f"SharedProjection: dim must be >= 1, got {self.dim}")
        if not 0 < self.density <= 1:
            raise ValueError(f"SharedProjection: density must be in (0, 1], got {self.density}")

    @property
    def k(self) -> int:
        """Number of shared positions."""
        return k_for(self.density, self.dim)

    def positions(self) -> np.ndarray:
        """The k shared positions, ascending, int64 shape ``(k,)``."""
        return np.flatnonzero(random_mask(derived_seed(self.seed, "positions"), self.dim, self.k))

    def _signs(self) -> torch.Tensor:
        bits = random_sign_bits(derived_seed(self.seed, "rotation"), self.dim)
        return torch.from_numpy(bits.astype(np.float64) * 2.0 - 1.0)

    def _hadamard(self, x: torch.Tensor) -> torch.Tensor:
        for off, size in power_of_two_blocks(self.dim):
            block = x[off : off + size]
            fwht_(block)
            block.mul_(1.0 / math.sqrt(size))
        return x

    def rotate_(self, x: torch.Tensor) -> torch.Tensor:
        """``x <- H D x`` in place (identity without rotation); x float64 shape ``(d,)``."""
        if self.rotate:
            x.mul_(self._signs())
            self._hadamard(x)
        return x

    def unrotate_(self, x: torch.Tensor) -> torch.Tensor:
        """``x <- D H x`` in place, the inverse of `rotate_` (H/sqrt(n) is its own inverse)."""
        if self.rotate:
            self._hadamard(x)
            x.mul_(self._signs())
        return x

    def encode(self, x: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
        """Select the shared entries of the (rotated) update.

        Parameters
        ----------
        x : np.ndarray
            Float update, shape ``(d,)``.

        Returns
        -------
        values : np.ndarray
            float64, shape ``(k,)``: ``(R x)[positions]``.
        rotated : torch.Tensor
            float64 ``R x``, shape ``(d,)`` (the caller computes its residual from it).
        """
        if x.shape != (self.dim,):
            raise ValueError(f"SharedProjection.encode: expected shape ({self.dim},), got {x.shape}")
        rotated = self.rotate_(torch.from_numpy(np.array(x, dtype=np.float64, copy=True)))
        return rotated.numpy()[self.positions()].copy(), rotated

    def decode(self, values: np.ndarray) -> np.ndarray:
        """Scatter k values into the shared positions and undo the rotation.

        Parameters
        ----------
        values : np.ndarray
            Shape ``(k,)``, finite.

        Returns
        -------
        np.ndarray
            float64, shape ``(d,)``.

        Raises
        ------
        ValueError
            Wrong length or non-finite values.
        """
        values = np.asarray(values, dtype=np.float64).reshape(-1)
        if values.shape != (self.k,):
            raise ValueError(f"secure aggregate has {values.size} values, the round's projection has k = {self.k}")
        if not np.isfinite(values).all():
            raise ValueError("secure aggregate has non-finite values")
        out = torch.zeros(self.dim, dtype=torch.float64, device="cpu")  # whatever the default device
        out[torch.from_numpy(self.positions())] = torch.from_numpy(values)
        return self.unrotate_(out).numpy()


__all__ = ["SharedProjection", "derived_seed", "round_seed"]
