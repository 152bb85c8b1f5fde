"""Distributed DP under secure aggregation with the Skellam mechanism (Flower-free).

Every client clips its (shared-seed encoded) update to L2 norm C, rounds it onto the integer grid
of step ``2c / Q`` that SecAgg+ sums, and adds its *share* of integer Skellam noise. A sum of
independent Skellam variables is Skellam, so the masked sum the server unmasks carries Skellam noise
of the summed variance: the server never sees an un-noised sum. The noise comes from a generator
seeded by the OS CSPRNG on each client (`fedcomp.privacy.mechanisms.secure_generator`).

Noise that survives dropouts: each client draws variance ``V / t`` per coordinate, where ``V``
(grid units) is the variance the noise multiplier asks of the sum and ``t`` is the round's
SecAgg+ reconstruction threshold. SecAgg+ unmasks a sum only when at least ``t`` clients' masked
vectors are in it, so the sum of the ``m >= t`` survivors carries variance ``m V / t >= V``; the
accountant charges each round with the ``m`` that was actually summed, a round refused after its
sum was unmasked included (the server has seen that sum).

Accounting: Rényi DP of the Skellam mechanism (Agarwal, Kairouz & Liu, "The Skellam Mechanism for
Differentially Private Federated Learning", NeurIPS 2021, Theorem 3.5 / Corollary 3.6): for integer
alpha > 1, noise variance ``mu`` per coordinate and integer-vector sensitivities Delta_1, Delta_2,

    eps(alpha) <= alpha Delta_2^2 / (2 mu) + min(((2 alpha - 1) Delta_2^2 + 6 Delta_1) / (4 mu^2),
                                                 3 Delta_1 / (2 mu)),

composed over rounds by adding RDP, converted to (epsilon, delta) by Opacus' conversion
(``opacus.accountants.analysis.rdp.get_privacy_spent``, Balle et al. AISTATS 2020). Neighbouring
federations differ in one client's whole update, replaced by zero (zero-out adjacency: the client
still takes part and adds its noise share), Delta_2 = C / step in grid units and
Delta_1 <= sqrt(k) Delta_2 for k coordinates. No amplification by sampling is claimed (q = 1). The
accountant counts the noise of every summed client: clients that collude with the server (and
reveal their shares) lower the noise that protects the others, which it does not model.

Rounding: clients round stochastically (each coordinate moves by less than one step), so they clip
to ``C - sqrt(k) * step`` first; the rounded vector then has L2 norm at most C (a deterministic
bound, looser than the conditional rounding of Kairouz et al., ICML 2021, and needing no
probability of failure).

Range: SecAgg+ clips each client's value to ``[-c, c]`` before it quantizes, which would change the
noise of a client whose noisy value falls outside. Clients refuse a round whose per-value
probability of that exceeds `OVERFLOW_LIMIT` (a Chernoff bound on the Skellam tail) and raise
rather than send a clipped value; the server reports the run's accumulated bound ``P`` of such an
event, and the guarantee of the released models is ``(epsilon, delta + (1 + e^epsilon) P)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from fedcomp.privacy.accounting import epsilon_from_rdp
from fedcomp.privacy.mechanisms import secure_generator
from fedcomp.util.validate import check_number

#: Integer Rényi orders the Skellam bound is evaluated at (Theorem 3.5 needs integer alpha > 1).
SKELLAM_ORDERS: tuple[int, ...] = tuple(range(2, 65)) + (72, 80, 96, 112, 128, 160, 192, 256, 384, 512, 1024)
#: Largest accepted probability that one client's noisy value leaves SecAgg+'s range ``[-c, c]``.
OVERFLOW_LIMIT = 1e-15


def skellam_rdp(orders, l1: float, l2: float, variance: float) -> np.ndarray:
    """RDP of the Skellam mechanism at each order (Agarwal, Kairouz & Liu 2021, Theorem 3.5).

    Parameters
    ----------
    orders : sequence of int
        Rényi orders alpha, integers > 1.
    l1, l2 : float
        L1 and L2 sensitivity of the integer vector (grid units), >= 0.
    variance : float
        mu > 0, the Skellam noise variance per coordinate of the released sum (grid units).

    Returns
    -------
    np.ndarray
        float64, shape ``(len(orders),)``: epsilon(alpha) of one release.

    Raises
    ------
    ValueError
        A non-integer order or one <= 1, a negative sensitivity, a variance <= 0.
    """
    if variance <= 0 or not math.isfinite(variance):
        raise ValueError(f"skellam_rdp: variance must be a finite number > 0, got {variance}")
    if l1 < 0 or l2 < 0:
        raise ValueError(f"skellam_rdp: sensitivities must be >= 0, got l1={l1}, l2={l2}")
    out = np.empty(len(orders), dtype=np.float64)
    for i, a in enumerate(orders):
        if float(a) != int(a) or a <= 1:
            raise ValueError(f"skellam_rdp: orders must be integers > 1, got {a}")
        a = int(a)
        out[i] = (a * l2 * l2 / (2 * variance)
                  + min(((2 * a - 1) * l2 * l2 + 6 * l1) / (4 * variance * variance), 3 * l1 / (2 * variance)))
    return out


def skellam_tail(variance: float, t: float) -> float:
    """Chernoff bound on ``P(X >= t)`` for X symmetric Skellam of variance ``variance`` (the
    difference of two Poisson(variance / 2)): ``exp(V (cosh l - 1) - l t)`` at ``l = asinh(t / V)``
    (its moment generating function is ``exp(V (cosh l - 1))``). 1.0 for ``t <= 0``; 0.0 for V = 0
    and t > 0."""
    if t <= 0:
        return 1.0
    if variance <= 0:
        return 0.0
    lam = math.asinh(t / variance)
    return math.exp(min(0.0, variance * (math.cosh(lam) - 1.0) - lam * t))


def skellam_noise(shape: tuple[int, ...], variance: float, generator: torch.Generator) -> torch.Tensor:
    """Integer symmetric Skellam noise: ``Poisson(variance / 2) - Poisson(variance / 2)`` per entry.

    Parameters
    ----------
    shape : tuple of int
    variance : float
        >= 0, per entry (0 gives zeros).
    generator : torch.Generator
        Source of the Poisson draws (`fedcomp.privacy.mechanisms.secure_generator` outside tests).

    Returns
    -------
    torch.Tensor
        int64 of ``shape``, mean 0, variance ``variance``.
    """
    if variance <= 0:
        return torch.zeros(shape, dtype=torch.int64)
    rate = torch.full(shape, variance / 2.0, dtype=torch.float64)
    return (torch.poisson(rate, generator=generator) - torch.poisson(rate, generator=generator)).to(torch.int64)


@dataclass
class DistributedDP:
    """Skellam distributed DP of the secure path: the clients' noise shares and the server's accountant.

    Parameters
    ----------
    clipping_norm : float
        C > 0, L2 bound of one client's encoded update (update units; run config ``clipping-norm``).
    noise_multiplier : float
        z > 0: the sum of ``t`` shares has standard deviation ``z * C`` per coordinate, as the
        Gaussian of central client-level DP (run config ``noise-multiplier``).
    clipping_range : float
        SecAgg+'s c (run config ``secagg-clipping-range``): values are summed in ``[-c, c]``.
    quantization_range : int
        SecAgg+'s Q = 2**bits (run config ``secagg-quantization-bits``); the grid step is ``2c / Q``.
    target_delta : float
        delta in (0, 1) at which epsilon is reported (default 1e-5; clients do not use it).

    Attributes
    ----------
    rounds : int
        Rounds recorded by `record`.
    overflow_bound : float
        Accumulated bound on the probability that a client's noisy value left ``[-c, c]``.

    Raises
    ------
    ValueError
        A parameter out of range, naming its run-config key; ``clipping_range <= clipping_norm``
        (no room for the noise).
    """

    clipping_norm: float
    noise_multiplier: float
    clipping_range: float
    quantization_range: int
    target_delta: float = 1e-5
    rounds: int = field(default=0, init=False)
    overflow_bound: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        check_number(self.clipping_norm, "run config 'clipping-norm'", lo=0.0, lo_open=True, hi=math.inf, hi_open=True)
        check_number(self.noise_multiplier, "run config 'noise-multiplier' (dp = 'distributed')", lo=0.0,
                     lo_open=True, hi=math.inf, hi_open=True)
        check_number(self.target_delta, "run config 'target-delta'", lo=0.0, lo_open=True, hi=1.0, hi_open=True)
        check_number(self.quantization_range, "secagg quantization range Q", lo=2, integer=True)
        if not self.clipping_range > self.clipping_norm:
            raise ValueError(
                f"dp = 'distributed': run config 'secagg-clipping-range' = {self.clipping_range:g} must "
                f"exceed 'clipping-norm' = {self.clipping_norm:g} (room for the noise shares; e.g. "
                f"{min_clipping_range(self.clipping_norm, self.noise_multiplier, 2, self.quantization_range):.3g} "
                "holds them for any threshold)")
        self._rdp = np.zeros(len(SKELLAM_ORDERS), dtype=np.float64)

    @property
    def step(self) -> float:
        """Grid step ``2c / Q`` (update units)."""
        return 2.0 * self.clipping_range / self.quantization_range

    @property
    def sum_variance(self) -> float:
        """V = (z C / step)**2: noise variance per coordinate of a sum of ``t`` shares (grid units)."""
        return (self.noise_multiplier * self.clipping_norm / self.step) ** 2

    def share_variance(self, threshold: int) -> float:
        """One client's noise variance per coordinate, ``V / t`` (grid units), for threshold t >= 1."""
        if threshold < 1:
            raise ValueError(f"dp = 'distributed': the SecAgg+ threshold must be >= 1, got {threshold}")
        return self.sum_variance / threshold

    def clip_bound(self, k: int) -> float:
        """L2 norm a client clips its k values to before rounding: ``C - sqrt(k) * step``.

        Raises
        ------
        ValueError
            A bound <= 0, naming the keys that raise it.
        """
        bound = self.clipping_norm - math.sqrt(k) * self.step
        if bound <= 0:
            raise ValueError(f"dp = 'distributed': the rounding slack sqrt(k) * 2c / Q = "
                             f"{math.sqrt(k) * self.step:.3g} exceeds 'clipping-norm' = {self.clipping_norm:g}: raise "
                             "'secagg-quantization-bits' or 'clipping-norm', or lower 'secagg-clipping-range'")
        return bound

    def overflow_probability(self, threshold: int) -> float:
        """Bound on the probability that one noisy value of one client leaves ``[-c, c]``: its
        rounded value lies within ``[-C, C]``, so the noise share must exceed ``(c - C) / step`` in
        magnitude (two-sided `skellam_tail`)."""
        margin = (self.clipping_range - self.clipping_norm) / self.step
        return min(1.0, 2.0 * skellam_tail(self.share_variance(threshold), margin))

    def check_range(self, threshold: int) -> None:
        """Refuse a round whose per-value overflow bound exceeds `OVERFLOW_LIMIT`.

        Raises
        ------
        ValueError
            Naming ``secagg-clipping-range`` and the value that would do.
        """
        p = self.overflow_probability(threshold)
        if p > OVERFLOW_LIMIT:
            need = min_clipping_range(self.clipping_norm, self.noise_multiplier, threshold, self.quantization_range)
            raise ValueError(f"dp = 'distributed': with threshold {threshold} a client's noise share (std "
                             f"{self.noise_multiplier * self.clipping_norm / math.sqrt(threshold):.3g}) leaves "
                             f"secagg-clipping-range = {self.clipping_range:g} with probability up to {p:.2g} per "
                             f"value (limit {OVERFLOW_LIMIT:g}): set 'secagg-clipping-range' >= {need:.3g}")

    def min_threshold(self) -> int:
        """Smallest threshold t >= 2 that `check_range` accepts (the shares shrink as t grows);
        2**20 if none up to it does."""
        hi = 2
        while hi < 1 << 20 and self.overflow_probability(hi) > OVERFLOW_LIMIT:
            hi *= 2
        lo = max(2, hi // 2)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if self.overflow_probability(mid) > OVERFLOW_LIMIT else (lo, mid)
        return hi

    def noise_share(self, k: int, threshold: int, generator: torch.Generator | None = None) -> np.ndarray:
        """One client's integer noise share for k values (grid units), int64 shape ``(k,)``, drawn
        from ``generator`` or, by default, a fresh `secure_generator` (OS CSPRNG)."""
        gen = generator if generator is not None else secure_generator()
        return skellam_noise((int(k),), self.share_variance(threshold), gen).numpy()

    def round_rdp(self, k: int, survivors: int, threshold: int) -> np.ndarray:
        """RDP curve (at `SKELLAM_ORDERS`) of one round whose sum holds ``survivors`` clients'
        shares of k values: variance ``survivors * V / t``, Delta_2 = C / step, Delta_1 = sqrt(k) Delta_2."""
        l2 = self.clipping_norm / self.step
        return skellam_rdp(SKELLAM_ORDERS, math.sqrt(k) * l2, l2, survivors * self.share_variance(threshold))

    def record(self, k: int, survivors: int, threshold: int) -> dict[str, float]:
        """Count one released round; returns its figures for the round metrics.

        Parameters
        ----------
        k : int
            Values per client in the sum.
        survivors : int
            Clients whose masked vectors were summed (>= 1).
        threshold : int
            The round's SecAgg+ reconstruction threshold (what each client divided its share by).

        Returns
        -------
        dict
            ``epsilon`` (cumulative, at ``target_delta``), ``dp-noise-std`` (std per coordinate of
            the summed noise, update units), ``dp-survivors``, ``dp-overflow-bound`` (accumulated).
        """
        if survivors < 1:
            raise ValueError(f"DistributedDP.record: survivors must be >= 1, got {survivors}")
        self._rdp = self._rdp + self.round_rdp(k, survivors, threshold)
        self.rounds += 1
        self.overflow_bound = min(1.0, self.overflow_bound + k * survivors * self.overflow_probability(threshold))
        return {"epsilon": self.epsilon(),
                "dp-noise-std": math.sqrt(survivors * self.share_variance(threshold)) * self.step,
                "dp-survivors": float(survivors), "dp-overflow-bound": self.overflow_bound}

    def epsilon_after(self, k: int) -> float:
        """Epsilon at ``target_delta`` if one more round of k values were released with the least noise
        SecAgg+ can unmask: as many survivors as the threshold t, whose shares add up to the variance
        of `sum_variance` whatever t is. What a privacy budget checks before a round."""
        return epsilon_from_rdp(SKELLAM_ORDERS, self._rdp + self.round_rdp(k, 1, 1), self.target_delta)

    def epsilon(self) -> float:
        """Cumulative epsilon of the recorded rounds at ``target_delta`` (0.0 before any)."""
        if self.rounds == 0:
            return 0.0
        return epsilon_from_rdp(SKELLAM_ORDERS, self._rdp, self.target_delta)


def min_clipping_range(clipping_norm: float, noise_multiplier: float, threshold: int, quantization_range: int,
                       limit: float = OVERFLOW_LIMIT) -> float:
    """Smallest SecAgg+ clipping range c (update units, to 3 significant digits, rounded up) at which
    `DistributedDP.overflow_probability` is at most ``limit`` for threshold t (bisection on c;
    the share's std is ``z C / sqrt(t)`` in update units whatever c is)."""
    std = noise_multiplier * clipping_norm / math.sqrt(max(threshold, 1))

    def ok(c: float) -> bool:
        step = 2.0 * c / quantization_range
        share = (noise_multiplier * clipping_norm / step) ** 2 / max(threshold, 1)
        return 2.0 * skellam_tail(share, (c - clipping_norm) / step) <= limit

    lo, hi = clipping_norm, clipping_norm + 100.0 * std
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    digits = 2 - math.floor(math.log10(hi))
    return math.ceil(hi * 10 ** digits) / 10 ** digits
