"""Update-level differential privacy (Flower-free): local clip-and-noise on the client and
client-level DP-FedAvg on the server, with Rényi-DP accounting over rounds.

Sources: McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private Recurrent Language
Models" (DP-FedAvg), ICLR 2018; Abadi et al., "Deep Learning with Differential Privacy", CCS 2016
(Gaussian mechanism with clipping); Mironov, "Rényi Differential Privacy", CSF 2017 (accounting,
through Opacus' ``RDPAccountant``).
"""

from __future__ import annotations

import functools
import math
import secrets
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from ._opacus import import_opacus

#: What the client-level accounting assumes; reported with every epsilon.
NO_AMPLIFICATION = ("sample rate q = 1: no privacy amplification by sampling is claimed (clients are not "
                    "Poisson-sampled from a fixed population); epsilon is per client, over all rounds")


def _check(name: str, value: float, lo: float, lo_open: bool, hi: float = math.inf, hi_open: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"run config '{name}' must be a number, got {value!r}")
    if (value <= lo if lo_open else value < lo) or (value >= hi if hi_open else value > hi):
        raise ValueError(f"run config '{name}' must be in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}, "
                         f"got {value!r}")
    return float(value)


def secure_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A torch Generator seeded from the OS CSPRNG (``secrets``): nothing in the run or node
    config (run seed, partition, round) can reproduce its draws. For privacy noise only, on the
    client (local DP) and the server (client-level DP) alike."""
    gen = torch.Generator(device=device)
    gen.manual_seed(secrets.randbits(63))
    return gen


def clip_and_noise(update: torch.Tensor, clipping_norm: float, noise_multiplier: float,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Clip a flat update to L2 norm ``clipping_norm``, then add N(0, (noise_multiplier·clipping_norm)²).

    Parameters
    ----------
    update : torch.Tensor
        1-D float tensor (the whole model update, flattened).
    clipping_norm : float
        C > 0.
    noise_multiplier : float
        z >= 0 (0: clipping only).
    generator : torch.Generator, optional
        Source of the Gaussian noise.

    Returns
    -------
    torch.Tensor
        float32, same shape: ``update * min(1, C/||update||) + N(0, (zC)^2 I)``.
    """
    u = update.float().clone()
    clip_and_noise_([u], clipping_norm, noise_multiplier, generator)
    return u


def clip_and_noise_(buffers: list[torch.Tensor], clipping_norm: float, noise_multiplier: float,
                    generator: torch.Generator | None = None) -> None:
    """:func:`clip_and_noise` in place over the concatenation of ``buffers`` (float32 tensors that
    together hold one update, e.g. one per payload): the L2 norm is taken over all of them, each is
    scaled by ``min(1, C/norm)`` and gets N(0, (zC)^2) noise per entry; no concatenated copy."""
    norm = sum(float(torch.linalg.vector_norm(b.double())) ** 2 for b in buffers) ** 0.5
    factor = min(1.0, clipping_norm / norm) if norm > 0 else 1.0
    std = noise_multiplier * clipping_norm
    for b in buffers:
        if factor < 1.0:
            b.mul_(factor)
        if std > 0:
            b.add_(torch.randn(b.shape, generator=generator, dtype=torch.float32).mul_(std))


@functools.lru_cache(maxsize=64)
def _rdp_per_round(sample_rate: float, noise_multiplier: float) -> tuple[tuple[float, ...], np.ndarray]:
    """Rényi DP of one (sampled) Gaussian-mechanism round at Opacus' default orders (cached:
    composition over rounds is a multiplication)."""
    import_opacus()
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import compute_rdp

    orders = tuple(RDPAccountant.DEFAULT_ALPHAS)
    return orders, np.asarray(compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1,
                                          orders=list(orders)))


def epsilon_from_rdp(orders, rdp, delta: float) -> float:
    """Convert Rényi DP curves to epsilon at ``delta``, never below 0.

    Opacus' conversion (Balle et al., "Hypothesis Testing Interpretations and Rényi
    Differential Privacy", AISTATS 2020, Thm. 21) is valid for every delta in (0, 1) but can
    return a negative value once delta is large (0.9 at z = 10: -2.29). (epsilon, delta)-DP
    with epsilon < 0 implies (0, delta)-DP, so 0 is the tightest non-negative statement it
    supports, and ``max(0, ·)`` keeps it valid, finite and non-decreasing over rounds (the
    RDP of every order only grows with composition).

    Parameters
    ----------
    orders : sequence of float
        Rényi orders alpha > 1.
    rdp : sequence of float
        RDP epsilon at each order (same length).
    delta : float
        In (0, 1).

    Returns
    -------
    float
        epsilon >= 0 (``inf`` when every order is infinite).
    """
    import_opacus()
    from opacus.accountants.analysis.rdp import get_privacy_spent

    with warnings.catch_warnings():  # "optimal order is the largest alpha": the bound still holds
        warnings.simplefilter("ignore", UserWarning)
        eps, _ = get_privacy_spent(orders=list(orders), rdp=rdp, delta=delta)
    return max(0.0, float(eps))


@dataclass
class ClientLevelDP:
    """DP-FedAvg on decoded updates: clip each client's update to ``clipping_norm``, sum, divide
    by the number of clients sampled in the round (fixed, not weighted by examples), add Gaussian
    noise of std ``noise_multiplier * clipping_norm / clients``. Clipping acts on the *decoded*
    update: with error feedback, ``||scale * sign||`` = scale·sqrt(n) can exceed any clip the
    client applied before compressing.

    Accounting: Rényi DP (Opacus ``RDPAccountant``), one sampled Gaussian-mechanism step per round
    at ``sample_rate`` (1 by default, see :data:`NO_AMPLIFICATION`); epsilon at ``target_delta``.

    Parameters
    ----------
    clipping_norm : float
        C > 0, L2 bound of one client's decoded update.
    noise_multiplier : float
        z >= 0; 0 gives no privacy (epsilon = inf).
    target_delta : float
        delta in (0, 1).
    seed : int, optional
        For unit tests only: reproducible noise. None (default, and what the ServerApp uses)
        seeds the noise from the OS CSPRNG (``secrets``): anyone who knows the run config
        (every client does) could otherwise regenerate the noise and subtract it from the model.
    sample_rate : float
        q in (0, 1]: 1 (default) claims no amplification; q < 1 is valid only when the strategy
        Poisson-samples each client of a fixed population with probability q
        (``client-sampling = "poisson"``), and then ``clients`` passed to :meth:`aggregate` is the
        expected number q·N (McMahan et al. 2018).

    Raises
    ------
    ValueError
        A parameter out of range (naming its run-config key).
    """

    clipping_norm: float
    noise_multiplier: float
    target_delta: float = 1e-5
    seed: int | None = None
    sample_rate: float = 1.0
    rounds: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        _check("clipping-norm", self.clipping_norm, 0.0, True)
        _check("noise-multiplier", self.noise_multiplier, 0.0, False)
        _check("target-delta", self.target_delta, 0.0, True, 1.0, True)
        _check("fraction-train", self.sample_rate, 0.0, True, 1.0, False)
        if self.seed is None:
            self._gen = secure_generator()
        else:
            self._gen = torch.Generator().manual_seed(int(self.seed))

    def clip_factor(self, norm: float) -> float:
        """``min(1, C / norm)``: the factor that clips an update of L2 norm ``norm`` to ``clipping_norm``."""
        return min(1.0, self.clipping_norm / norm) if norm > 0 else 1.0

    def aggregate(self, updates: list[np.ndarray], clients: int) -> tuple[np.ndarray, dict[str, float]]:
        """Clip, sum, divide by ``clients``, add noise; count one round in the accountant.

        Parameters
        ----------
        updates : list of np.ndarray
            Flat float32 decoded updates, one per client that replied (all the same length).
        clients : int
            Clients sampled this round (>= len(updates); the divisor).

        Returns
        -------
        (aggregate, info)
            As :meth:`finish`.
        """
        norms = [float(np.linalg.norm(u.astype(np.float64))) for u in updates]
        total = np.zeros_like(updates[0], dtype=np.float64)
        for u, n in zip(updates, norms):
            total += u.astype(np.float64) * self.clip_factor(n)
        return self.finish(total, norms, clients)

    def finish(self, clipped_sum: np.ndarray, norms: list[float], clients: float) -> tuple[np.ndarray, dict[str, float]]:
        """Divide the sum of clipped updates by ``clients``, add the noise; count one round.

        Parameters
        ----------
        clipped_sum : np.ndarray
            float64, flat: ``sum_i clip_factor(||u_i||) * u_i`` (folded reply by reply by the server).
        norms : list of float
            The updates' L2 norms before clipping (for the reported statistics).
        clients : float
            Clients sampled this round (the divisor; q*N under Poisson sampling).

        Returns
        -------
        (aggregate, info)
            float32 flat aggregate update; ``clipped-fraction`` (share of updates that were
            clipped), ``max-update-norm`` (before clipping), ``epsilon`` (cumulative).
        """
        agg = clipped_sum / clients
        if self.noise_multiplier > 0:
            std = self.noise_multiplier * self.clipping_norm / clients
            agg = agg + torch.randn(agg.shape, generator=self._gen, dtype=torch.float64).numpy() * std
        self.rounds += 1
        return agg.astype(np.float32), {
            "clipped-fraction": float(np.mean([n > self.clipping_norm for n in norms])) if norms else 0.0,
            "max-update-norm": max(norms) if norms else 0.0,
            "epsilon": self.epsilon(self.rounds),
        }

    def epsilon(self, rounds: int) -> float:
        """Cumulative epsilon after ``rounds`` rounds at ``target_delta`` (inf without noise)."""
        if rounds <= 0:
            return 0.0
        if self.noise_multiplier == 0:
            return math.inf
        orders, per_round = _rdp_per_round(self.sample_rate, self.noise_multiplier)
        return epsilon_from_rdp(orders, per_round * rounds, self.target_delta)


def check_accountable(noise_multiplier: float, target_delta: float, sample_rate: float = 1.0) -> None:
    """Start-up check that the RDP accountant can compute epsilon for ``noise_multiplier`` (issue
    21, item 11: 1e-200 passed the range check, then every round raised ``ZeroDivisionError``).

    0 (no noise: epsilon = inf) is accepted; any other value must give a number for one round.

    Raises
    ------
    ValueError
        Naming run config 'noise-multiplier', when the accountant fails or returns NaN for it.
    """
    if noise_multiplier == 0:
        return
    try:
        eps = ClientLevelDP(1.0, noise_multiplier, target_delta, sample_rate=sample_rate).epsilon(1)
    except (ArithmeticError, ValueError) as exc:
        raise ValueError(f"run config 'noise-multiplier' = {noise_multiplier!r} is too small for the RDP accountant "
                         f"to compute epsilon ({type(exc).__name__}: {exc}); use 0 for no noise (epsilon = inf) or "
                         "a noise multiplier of at least 1e-20") from None
    if eps != eps:
        raise ValueError(f"run config 'noise-multiplier' = {noise_multiplier!r}: the RDP accountant gives no epsilon "
                         "(NaN) for it")


@dataclass(frozen=True)
class LocalDP:
    """Local update noise: each client clips its whole update to ``clipping_norm`` and adds
    N(0, (noise_multiplier·clipping_norm)²) *before* compression and error feedback, so every
    selection (top-k positions, signs, STC's mean) is computed from the noisy update.

    Raises
    ------
    ValueError
        ``clipping_norm`` <= 0 or ``noise_multiplier`` < 0.
    """

    clipping_norm: float
    noise_multiplier: float
    target_delta: float = 1e-5

    def __post_init__(self) -> None:
        _check("clipping-norm", self.clipping_norm, 0.0, True)
        _check("noise-multiplier", self.noise_multiplier, 0.0, False)
        _check("target-delta", self.target_delta, 0.0, True, 1.0, True)

    def epsilon(self, rounds: int, target_delta: float | None = None) -> float:
        """Per-client epsilon of ``rounds`` noisy releases (RDP, q = 1), inf without noise."""
        delta = self.target_delta if target_delta is None else target_delta
        return ClientLevelDP(self.clipping_norm, self.noise_multiplier, delta).epsilon(rounds)
