"""Client-level DP-FedAvg on the server's decoded updates (Flower-free).

Source: McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private Recurrent Language
Models" (DP-FedAvg), ICLR 2018; Rényi-DP accounting (`fedcomp.privacy.accounting`), one
sampled Gaussian-mechanism step per round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from fedcomp.privacy.accounting import epsilon_from_rdp, rdp_one_step, rdp_orders
from fedcomp.privacy.mechanisms import secure_generator
from fedcomp.util.validate import check_number


def check_gaussian_parameters(clipping_norm: float, noise_multiplier: float, target_delta: float) -> None:
    """Clipping norm C > 0, noise multiplier z >= 0, delta in (0, 1), each finite.

    Raises
    ------
    ValueError
        Naming the run-config key of the first one out of range.
    """
    check_number(clipping_norm, "run config 'clipping-norm'", lo=0.0, lo_open=True, hi=math.inf, hi_open=True)
    check_number(noise_multiplier, "run config 'noise-multiplier'", lo=0.0, hi=math.inf, hi_open=True)
    check_number(target_delta, "run config 'target-delta'", lo=0.0, lo_open=True, hi=1.0, hi_open=True)

#: What the client-level accounting assumes; reported with every epsilon.
NO_AMPLIFICATION = ("sample rate q = 1: no privacy amplification by sampling is claimed (clients are not "
                    "Poisson-sampled from a fixed population); epsilon is per client, over all rounds")


@dataclass
class ClientLevelDP:
    """DP-FedAvg on decoded updates: clip each client's update to ``clipping_norm``, sum, divide
    by the number of clients sampled in the round (fixed, not weighted by examples), add Gaussian
    noise of std ``noise_multiplier * clipping_norm / clients``. Clipping acts on the *decoded*
    update: with error feedback, ``||scale * sign||`` = scale·sqrt(n) can exceed any clip the
    client applied before compressing.

    Accounting: Rényi DP (Opacus ``RDPAccountant``), one sampled Gaussian-mechanism step per round
    at ``sample_rate`` (1 by default, see `NO_AMPLIFICATION`); epsilon at ``target_delta``.

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
        (``client-sampling = "poisson"``), and then ``clients`` passed to `aggregate` is the
        expected number q·N (McMahan et al. 2018).

    Raises
    ------
    ValueError
        A parameter out of range (naming its run-config key, or ``sample_rate``).
    """

    clipping_norm: float
    noise_multiplier: float
    target_delta: float = 1e-5
    seed: int | None = None
    sample_rate: float = 1.0
    rounds: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        check_gaussian_parameters(self.clipping_norm, self.noise_multiplier, self.target_delta)
        check_number(self.sample_rate, "sample_rate (Poisson rate q: run config 'fraction-train' under "
                     "client-sampling = 'poisson')", lo=0.0, lo_open=True, hi=1.0)
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
            As `finish`.
        """
        norms = [float(np.linalg.norm(u.astype(np.float64))) for u in updates]
        total = np.zeros_like(updates[0], dtype=np.float64)
        for u, n in zip(updates, norms):
            total += u.astype(np.float64) * self.clip_factor(n)
        return self.finish(total, norms, clients)

    def finish(self, clipped_sum: np.ndarray, norms: list[float],
               clients: float) -> tuple[np.ndarray, dict[str, float]]:
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
        per_round = rdp_one_step(self.sample_rate, self.noise_multiplier)
        return epsilon_from_rdp(rdp_orders(), per_round * rounds, self.target_delta)


def check_accountable(noise_multiplier: float, target_delta: float, sample_rate: float = 1.0) -> None:
    """Start-up check that the RDP accountant can compute epsilon for ``noise_multiplier``: a
    tiny positive value such as 1e-200 passes the range check, but the accountant raises
    ``ZeroDivisionError`` on it.

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
