"""Privacy accounting (Flower-free): Rényi DP of the (subsampled) Gaussian mechanism, its
conversion to (epsilon, delta), and the per-client DP-SGD accountant kept between rounds as plain
data.

Sources: Mironov, "Rényi Differential Privacy", CSF 2017; Mironov, Talwar & Zhang, "Rényi
Differential Privacy of the Sampled Gaussian Mechanism", 2019; Gopi, Lee & Wutschitz, "Numerical
Composition of Differential Privacy", NeurIPS 2021 (PRV); Opacus 1.6's accountants.

Opacus is imported inside the functions, through `fedcomp.privacy.opacus_import.import_opacus` (it calls
``logging.basicConfig`` at import, which would print every log line twice).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from fedcomp.privacy.opacus_import import import_opacus

if TYPE_CHECKING:
    from opacus.accountants import IAccountant

#: Accountants DP-SGD accepts (run config ``accountant``).
ACCOUNTANTS = ("rdp", "prv")
#: Keys of the plain-data accountant state: parallel lists of floats, one entry per
#: (noise multiplier, sample rate) segment of the history.
STATE_KEYS = ("noise-multiplier", "sample-rate", "steps")


def checked_max_epsilon(max_epsilon) -> float | None:
    """A privacy budget (run config ``max-epsilon``) as a float, or None for no budget.

    Raises
    ------
    ValueError
        Not None and not a finite number > 0 (bools refused), naming the key.
    """
    if max_epsilon is not None and (isinstance(max_epsilon, (bool, np.bool_))
                                    or not isinstance(max_epsilon, (int, float, np.integer, np.floating))
                                    # also NaN, inf, ints past float range
                                    or not 0 < (float(max_epsilon) if isinstance(max_epsilon, np.generic)
                                                else max_epsilon) <= sys.float_info.max):
        raise ValueError(f"max_epsilon (run config 'max-epsilon') must be a finite number > 0, or None for no "
                         f"budget; got {max_epsilon!r}")
    return None if max_epsilon is None else float(max_epsilon)


def rdp_orders() -> tuple[float, ...]:
    """The Rényi orders alpha every epsilon here is computed at (Opacus' defaults)."""
    import_opacus()
    from opacus.accountants import RDPAccountant

    return tuple(RDPAccountant.DEFAULT_ALPHAS)


@lru_cache(maxsize=256)
def rdp_one_step(sample_rate: float, noise_multiplier: float) -> np.ndarray:
    """RDP of one Poisson-subsampled Gaussian step (a client-level round at q, or a DP-SGD step) at
    each of `rdp_orders` (Mironov, Talwar & Zhang 2019), shape ``(len(rdp_orders()),)``,
    read-only. Cached: it depends only on (q, sigma), which stay fixed over a run, and is the
    costly part (Opacus' series at every order); composition over steps or rounds is a
    multiplication."""
    import_opacus()
    from opacus.accountants.analysis import rdp as rdp_analysis

    rdp = rdp_analysis.compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1,
                                   orders=list(rdp_orders()))
    rdp = np.asarray(rdp, dtype=np.float64)
    rdp.flags.writeable = False
    return rdp


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


def new_accountant(kind: str = "rdp") -> IAccountant:
    """An empty Opacus accountant, ``kind`` in `ACCOUNTANTS`.

    Raises
    ------
    ValueError
        Unknown kind (naming ``accountant``).
    """
    if kind not in ACCOUNTANTS:
        raise ValueError(f"run config 'accountant' must be one of {list(ACCOUNTANTS)}, got {kind!r}")
    import_opacus()
    from opacus.accountants import create_accountant

    return create_accountant(mechanism=kind)


def accountant_state(accountant: IAccountant) -> dict[str, list[float]]:
    """The accountant's history as parallel lists of Python floats.

    Returns
    -------
    dict
        ``{"noise-multiplier": [sigma_i], "sample-rate": [q_i], "steps": [T_i]}``, one entry
        per segment of consecutive steps with the same (sigma, q); ``T_i`` are whole numbers
        stored as floats. Valid as a Flower ``MetricRecord``; empty lists for no steps.
        The same format serves "rdp" and "prv" (both keep this history).
    """
    sigmas, rates, steps = [], [], []
    for sigma, q, t in accountant.history:
        sigmas.append(float(sigma))
        rates.append(float(q))
        steps.append(float(t))
    return {"noise-multiplier": sigmas, "sample-rate": rates, "steps": steps}


def restore_accountant(kind: str, state: Mapping[str, Any] | None) -> IAccountant:
    """An accountant of ``kind`` whose history is ``state`` (from `accountant_state`).

    Parameters
    ----------
    kind : {"rdp", "prv"}
    state : mapping or None
        None or an empty mapping gives an empty accountant (first round).

    Raises
    ------
    ValueError
        Missing keys, lists of different lengths, sigma < 0, q outside (0, 1], or steps that
        are not whole numbers >= 1.
    """
    acc = new_accountant(kind)
    if not state:
        return acc
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise ValueError(f"accountant state lacks {missing}; expected keys {list(STATE_KEYS)}")
    sigmas, rates, steps = (list(state[k]) for k in STATE_KEYS)
    if not len(sigmas) == len(rates) == len(steps):
        raise ValueError(f"accountant state lists differ in length: {len(sigmas)}, {len(rates)}, {len(steps)}")
    history = []
    for sigma, q, t in zip(sigmas, rates, steps):
        sigma, q, t = float(sigma), float(q), float(t)
        if not sigma >= 0 or not 0 < q <= 1 or not t >= 1 or not t.is_integer():
            raise ValueError(f"invalid accountant state entry (noise-multiplier={sigma}, sample-rate={q}, steps={t})")
        history.append((sigma, q, int(t)))
    acc.history = history
    return acc


def epsilon_spent(accountant: IAccountant, delta: float) -> float:
    """Epsilon of everything the accountant recorded, at ``delta``.

    0.0 for an empty history; ``float('inf')`` ("no privacy") as soon as any step used
    noise multiplier 0; otherwise the accountant's bound (RDP: Mironov 2017 with Opacus'
    conversion; PRV: the upper bound of Gopi et al. 2021), floored at 0 as explained in
    `epsilon_from_rdp` (finite, >= 0, non-decreasing over rounds).
    """
    if not accountant.history:
        return 0.0
    if any(sigma == 0 for sigma, _, _ in accountant.history):
        return float("inf")
    if accountant.mechanism() == "rdp":
        # Same arithmetic as RDPAccountant.get_epsilon, with the per-step RDP curve cached.
        rdp = sum(t * rdp_one_step(q, sigma) for sigma, q, t in accountant.history)
        return epsilon_from_rdp(rdp_orders(), rdp, delta)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        # PRV's numerical bound also dips below 0 at large delta; (eps < 0, delta) implies (0, delta)
        return max(0.0, float(accountant.get_epsilon(delta=delta)))
