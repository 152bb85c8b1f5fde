"""Noise calibration and the sampling arithmetic of DP-SGD (Flower-free): Poisson sample rate,
steps per epoch, and the noise multiplier that reaches a target epsilon.

Source: Abadi et al., "Deep Learning with Differential Privacy", CCS 2016; Opacus 1.6's
``get_noise_multiplier`` (bisection over sigma).
"""

from __future__ import annotations

import math
import warnings
from functools import lru_cache

from fedcomp.privacy.opacus_import import import_opacus


def logical_batch_size(batch_size: int, accumulation_steps: int = 1) -> int:
    """Logical (expected) batch size ``batch_size * accumulation_steps``, in samples: what one
    optimizer step averages over when ``accumulation_steps`` micro-batches of ``batch_size`` make a step."""
    return int(batch_size) * int(accumulation_steps)


def sample_rate(num_examples: int, logical_batch: int) -> float:
    """Poisson sampling probability ``q = min(1, logical_batch / num_examples)``.

    Raises
    ------
    ValueError
        ``num_examples < 1`` or ``logical_batch < 1``.
    """
    if num_examples < 1 or logical_batch < 1:
        raise ValueError(f"need num_examples >= 1 and logical_batch >= 1, got {num_examples}, {logical_batch}")
    return min(1.0, logical_batch / num_examples)


def steps_per_epoch(num_examples: int, logical_batch: int) -> int:
    """Optimizer steps per local epoch, ``ceil(num_examples / logical_batch)`` (>= 1).

    The same number of steps as the plain loop's ``len(DataLoader)``, so one epoch visits
    ``num_examples`` samples in expectation when ``logical_batch`` divides it.
    """
    sample_rate(num_examples, logical_batch)  # validates
    return max(1, math.ceil(num_examples / logical_batch))


@lru_cache(maxsize=64)
def calibrate_noise_multiplier(
    *, target_epsilon: float, target_delta: float, sample_rate: float, steps: int, accountant: str = "rdp"
) -> float:
    """Smallest noise multiplier (up to the search tolerance) whose epsilon after ``steps``
    Poisson-subsampled Gaussian steps at rate ``sample_rate`` is at most ``target_epsilon``.

    Opacus' own ``get_noise_multiplier`` (bisection over sigma) with its default tolerance
    (0.01 absolute in epsilon), so the returned sigma is exactly the one Opacus reports for the
    same inputs and spends between ``target_epsilon - 0.01`` and ``target_epsilon``.
    Results are cached (the inputs are the same every round).

    Parameters
    ----------
    target_epsilon : float
        Budget, > 0.
    target_delta : float
        In (0, 1).
    sample_rate : float
        q in (0, 1].
    steps : int
        Planned optimizer steps of the whole run, >= 1.
    accountant : {"rdp", "prv"}

    Returns
    -------
    float
        sigma (dimensionless: noise std / max_grad_norm).

    Raises
    ------
    ValueError
        Naming ``target-epsilon`` when no sigma up to 1e6 reaches the target (for "rdp" at
        delta = 1e-5, targets below ~0.12 are out of reach whatever the noise).
    """
    import_opacus()
    from opacus.accountants.utils import get_noise_multiplier

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # PRV's log(0) branches
            warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")  # probes
            return float(get_noise_multiplier(
                target_epsilon=target_epsilon, target_delta=target_delta, sample_rate=sample_rate,
                steps=steps, accountant=accountant,
            ))
    except ValueError as exc:
        raise ValueError(
            f"run config 'target-epsilon' = {target_epsilon} is not reachable at target-delta = "
            f"{target_delta} with the {accountant!r} accountant (no noise multiplier up to 1e6 "
            f"gets there: {exc}); raise target-epsilon or target-delta"
        ) from None
