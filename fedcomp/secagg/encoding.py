"""Shared-randomness linear encoding of a model update for secure aggregation (Flower-free).

Every client of a round derives the same k positions (shared-seed random-k) and, optionally,
the same randomised Hadamard rotation from one per-round seed that the server sends in the
train config. The encoding ``x -> (R x)[positions]`` is linear and identical across clients,
so the sum of the encoded vectors is the encoding of the sum: it survives SecAgg+'s masked
summation. The server scatters the unmasked sum back into the positions and undoes the rotation
(`fedcomp.compression.shared_projection`).

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

import math

import numpy as np

from fedcomp.compression.shared_projection import SharedProjection, derived_seed, round_seed

#: The shared projection lives with the codecs (the download decodes it too); named here for the secure path.
__all__ = ["SharedProjection", "add_noise_share", "derived_seed", "flower_weight", "modulus_bits_for", "prequantize",
           "quantization_bound", "round_seed", "weight_floor"]


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
