"""Shared-randomness linear encoding of a model update for secure aggregation (Flower-free).

Every client of a round derives the same k positions (shared-seed random-k) and, optionally,
the same randomised Hadamard rotation from one per-round seed that the server sends in the
train config. The encoding ``x -> (R x)[positions]`` is linear and identical across clients,
so the sum of the encoded vectors is the encoding of the sum: it survives SecAgg+'s masked
summation. The server scatters the unmasked sum back into the positions and undoes the rotation.

The values are also pre-rounded onto SecAgg+'s quantization grid (stochastic rounding) by the
client, so Flower's own quantizer is exact on them and error feedback sees the real error.
Under distributed DP a client adds its integer Skellam noise share on that same grid
(`add_noise_share`, `fedcomp.privacy.distributed`).

Sources: Stich, Cordonnier, Jaggi, NeurIPS 2018 (rand-k with memory); Konečný et al. 2016
(shared random masks); Chen, Choquette-Choo, Kairouz, Suresh, ICML 2022 ("The Fundamental
Price of Secure Aggregation in Differentially Private Federated Learning": shared-randomness
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
        out = torch.zeros(self.dim, dtype=torch.float64)
        out[torch.from_numpy(self.positions())] = torch.from_numpy(values)
        return self.unrotate_(out).numpy()


def flower_weight(num_examples: int, max_weight: float, quantization_range: int) -> float:
    """The weight SecAgg+ gives a client: ``round(num_examples / max_weight * Q) / Q``.

    Flower's ``secaggplus_mod`` multiplies the client's vector by this and sums it into the
    denominator, so the unmasked result is the mean weighted by these (rounded) weights.

    Raises
    ------
    ValueError
        ``num_examples < 1``, ``num_examples > max_weight`` (the weighted values and the weight sum
        could overflow the modulus) or a weight that rounds to 0.
    """
    if not num_examples >= 1:
        raise ValueError(f"num-examples = {num_examples}: a client needs at least one training example to take part "
                         "in a secure round")
    if num_examples > max_weight:
        raise ValueError(f"this client has num-examples = {num_examples} > secagg-max-weight = {max_weight}: the "
                         "masked sum could overflow; raise 'secagg-max-weight' to at least the largest client's size")
    q = round(num_examples / max_weight * quantization_range)
    if q < 1:
        raise ValueError(f"num-examples = {num_examples} rounds to weight 0 with secagg-max-weight = {max_weight} "
                         f"and quantization range {quantization_range}: lower 'secagg-max-weight'")
    return q / quantization_range


def weight_floor(max_weight: float, quantization_range: int) -> int:
    """The smallest ``num_examples`` whose SecAgg+ weight does not round to 0:
    ``ceil(max_weight / Q)`` (its weight is at least one step, ``1 / Q``).

    With few quantization levels (Q = 2**3: one step is 125 examples at ``max_weight`` 1000) a small
    client reports this count instead of its own, so that it is weighted at one step instead of being
    refused; the server's check of the weight sum uses the reported count.
    """
    return max(1, math.ceil(float(max_weight) / int(quantization_range)))


def prequantize(values: np.ndarray, weight: float, clipping_range: float, quantization_range: int,
                rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """Round ``weight * values`` onto SecAgg+'s grid, stochastically (unbiased inside the range).

    Flower's quantizer maps ``t in [-c, c]`` to ``(t + c) * Q / (2c)`` and rounds stochastically;
    on values already on the grid it is exact, so this function decides the rounding and error
    feedback keeps what it removed (clipping included).

    Parameters
    ----------
    values : np.ndarray
        float64 shape ``(k,)``, the selected update entries.
    weight : float
        `flower_weight` of this client, in (0, 1].
    clipping_range, quantization_range : float, int
        SecAgg+'s c and Q.
    rng : np.random.Generator
        Randomness of the rounding.

    Returns
    -------
    sent : np.ndarray
        float64 shape ``(k,)``: the values whose ``weight * sent`` lies exactly on the grid
        (what the server will effectively sum, in update units).
    clipped : int
        Entries clipped to +-c.
    """
    c, q = float(clipping_range), int(quantization_range)
    t = values * weight
    clipped = int(np.count_nonzero(np.abs(t) > c))
    u = (np.clip(t, -c, c) + c) * (q / (2 * c))
    j = np.floor(u)
    j += rng.random(u.shape) < (u - j)
    np.clip(j, 0, q, out=j)
    return (j * (2 * c / q) - c) / weight, clipped


def modulus_bits_for(num_clients: int, quantization_range: int) -> int:
    """Bits of the smallest power-of-two modulus that holds the sum of ``num_clients`` quantized
    values (each in ``[0, Q]``) and of their weights (each ``<= Q``): ``ceil(log2(n * Q + 1))``."""
    return max(1, math.ceil(math.log2(num_clients * quantization_range + 1)))


def quantization_bound(weights: list[float], clipping_range: float, quantization_range: int) -> float:
    """Largest per-entry difference between the secure weighted mean and the plain weighted mean
    (same weights, no clipping): each client's rounding moves ``w_i * x_i`` by less than one step
    ``2c / Q``, so the mean moves by less than ``n * 2c / Q / sum(w_i)``."""
    return len(weights) * 2 * clipping_range / quantization_range / sum(weights)


def add_noise_share(sent: np.ndarray, ddp, k: int, threshold: int, generator=None) -> np.ndarray:
    """``sent`` (k values on SecAgg+'s grid, weight 1) plus this client's Skellam noise share, on the grid.

    Parameters
    ----------
    sent : np.ndarray
        float64 shape ``(k,)``, each ``j * step - c`` for an integer j in ``[0, Q]``.
    ddp : fedcomp.privacy.distributed.DistributedDP
    k, threshold : int
        Values and the round's SecAgg+ reconstruction threshold.
    generator : torch.Generator, optional
        Tests only; by default a fresh OS-CSPRNG generator.

    Returns
    -------
    np.ndarray
        float64 shape ``(k,)``: ``(j + noise) * step - c``.

    Raises
    ------
    ValueError
        A noisy value outside ``[-c, c]`` (SecAgg+ would clip it and change the noise): the client
        sends nothing this round (SecAgg+ treats it as dropped).
    """
    c, q = ddp.clipping_range, ddp.quantization_range
    j = np.rint((sent + c) * (q / (2 * c))) + ddp.noise_share(k, threshold, generator)
    if j.size and (j.min() < 0 or j.max() > q):
        raise ValueError("dp = 'distributed': a noisy value left secagg-clipping-range; this client sends nothing "
                         "this round (raise 'secagg-clipping-range')")
    return j * (2 * c / q) - c
