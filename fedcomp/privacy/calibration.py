"""Noise calibration and the sampling arithmetic of DP-SGD (Flower-free): Poisson sample rate,
steps per epoch and per run, the noise multiplier that reaches a target epsilon, and the epsilon
one more round would cost.

Source: Abadi et al., "Deep Learning with Differential Privacy", CCS 2016; Opacus 1.6's
``get_noise_multiplier`` (bisection over sigma).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from .._opacus import import_opacus
from .accounting import epsilon_spent, restore_accountant

if TYPE_CHECKING:
    from ..training import TrainConfig
    from .sample_level import DPSGDConfig


def logical_batch_size(train_cfg: TrainConfig) -> int:
    """Logical (expected) batch size ``batch_size * accumulation_steps``, in samples."""
    return int(train_cfg.batch_size) * int(train_cfg.accumulation_steps)


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

    Bisection over sigma with Opacus' ``get_noise_multiplier``; the tolerance is 0.5 % of
    the target, so the returned sigma spends between 99.5 % and 100 % of the budget.
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
                steps=steps, accountant=accountant, epsilon_tolerance=0.005 * target_epsilon,
            ))
    except ValueError as exc:
        raise ValueError(
            f"run config 'target-epsilon' = {target_epsilon} is not reachable at target-delta = "
            f"{target_delta} with the {accountant!r} accountant (no noise multiplier up to 1e6 "
            f"gets there: {exc}); raise target-epsilon or target-delta"
        ) from None


def planned_steps(dp_cfg: DPSGDConfig, train_cfg: TrainConfig, num_examples: int) -> int:
    """Optimizer steps of the whole planned run on this client:
    ``planned_rounds * local_epochs * steps_per_epoch``."""
    per_epoch = steps_per_epoch(num_examples, logical_batch_size(train_cfg))
    return dp_cfg.planned_rounds * int(train_cfg.local_epochs) * per_epoch


def resolve_noise_multiplier(dp_cfg: DPSGDConfig, train_cfg: TrainConfig, num_examples: int) -> float:
    """The sigma this client uses: ``dp_cfg.noise_multiplier``, or with ``target_epsilon``
    the calibrated one for :func:`planned_steps` at this client's sample rate.

    Raises
    ------
    ValueError
        Unreachable target epsilon (naming ``target-epsilon``).
    """
    if dp_cfg.target_epsilon is None:
        return float(dp_cfg.noise_multiplier)
    q = sample_rate(num_examples, logical_batch_size(train_cfg))
    return calibrate_noise_multiplier(
        target_epsilon=float(dp_cfg.target_epsilon), target_delta=float(dp_cfg.target_delta),
        sample_rate=q, steps=planned_steps(dp_cfg, train_cfg, num_examples), accountant=dp_cfg.accountant,
    )


def projected_epsilon(dp_cfg: DPSGDConfig, train_cfg: TrainConfig, num_examples: int,
                      accountant_state: Mapping[str, Any] | None) -> float:
    """Epsilon this client would have after one more round (at ``target_delta``), without training.

    Adds this round's steps (``local_epochs * steps_per_epoch`` at this client's sample rate and
    noise multiplier) to a copy of the restored accountant; used to refuse a round that would
    exceed a privacy budget before any data is touched.
    """
    acc = restore_accountant(dp_cfg.accountant, accountant_state)
    sigma = resolve_noise_multiplier(dp_cfg, train_cfg, num_examples)
    q = sample_rate(num_examples, logical_batch_size(train_cfg))
    steps = int(train_cfg.local_epochs) * steps_per_epoch(num_examples, logical_batch_size(train_cfg))
    if sigma == 0:
        return math.inf
    acc.history.append((sigma, q, steps))
    return epsilon_spent(acc, dp_cfg.target_delta)
