"""Settings of sample-level DP-SGD (run config ``dp = "dp-sgd"``) and the plan they give one client
(steps of the run, its noise multiplier, the epsilon one more round would cost): read by the
ClientApp that trains with them, validated by the ServerApp at start-up. Opacus is imported only
when a target epsilon needs calibrating or an epsilon computing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedcomp.privacy.accounting import ACCOUNTANTS, epsilon_spent, restore_accountant
from fedcomp.privacy.calibration import calibrate_noise_multiplier, sample_rate, steps_per_epoch
from fedcomp.privacy.settings import DP_DEFAULTS, DP_KEYS
from fedcomp.util.validate import read_number


def secure_rng_available() -> bool:
    """Whether Opacus' secure mode can run here (it needs the ``torchcsprng`` package)."""
    try:
        import torchcsprng  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class DPSGDConfig:
    """DP-SGD parameters (run config keys in brackets, declared in
    `fedcomp.privacy.settings.DP_KEYS` with their defaults); validated on construction.

    Attributes
    ----------
    noise_multiplier : float
        sigma [``noise-multiplier``], >= 0: the Gaussian noise added to each summed logical
        batch gradient has standard deviation ``sigma * max_grad_norm``. 0 means no privacy
        (epsilon is reported as ``inf``). Default 1.0, a common starting point (Opacus
        examples). Ignored when ``target_epsilon`` is set.
    max_grad_norm : float
        C [``max-grad-norm``], > 0: L2 bound each per-sample gradient is clipped to (flat
        clipping over all parameters). Default 1.0 (Abadi et al. 2016 use 4; smaller C clips
        more and needs less absolute noise).
    target_delta : float
        delta [``target-delta``], in (0, 1): the delta at which epsilon is reported. Default
        1e-5; it should be well below ``1 / N`` (N = local examples).
    target_epsilon : float or None
        [``target-epsilon``], > 0, optional. When set, sigma is calibrated once so that the
        whole planned run (``planned_rounds`` rounds x ``local_epochs`` x steps per epoch,
        assuming the client trains in every round) ends at this epsilon; ``noise_multiplier``
        is then ignored. A client that trains in fewer rounds ends below it; one that trains
        in more rounds ends above it (the reported epsilon says so).
    planned_rounds : int
        Rounds the calibration plans for [``num-server-rounds``], >= 1. Default 50, as the
        app config's default.
    accountant : {"rdp", "prv"}
        [``accountant``]. "rdp" (default): Renyi DP (Mironov 2017), fast and slightly loose.
        "prv": numerical composition of privacy loss random variables (Gopi et al. 2021),
        tighter (smaller epsilon for the same noise) but slower: each epsilon query is a
        numerical computation over the discretised privacy loss distribution.
    secure_rng : bool
        [``secure-rng``]. True would draw noise and Poisson samples from a cryptographically
        secure generator (Opacus ``secure_mode``, which needs the ``torchcsprng`` package).
        Default False: seeded ``torch.Generator`` draws, reproducible and fine for
        experiments, but not a guarantee against an adversary who can predict the PRNG.

    Raises
    ------
    ValueError
        Naming the run-config key: delta outside (0, 1), max-grad-norm <= 0, noise-multiplier
        < 0, target-epsilon <= 0 or below what any amount of noise reaches at this delta, an
        unknown accountant, num-server-rounds < 1, or secure-rng = true where torchcsprng is
        not installed.
    """

    noise_multiplier: float = DP_DEFAULTS["noise-multiplier"]
    max_grad_norm: float = DP_DEFAULTS["max-grad-norm"]
    target_delta: float = DP_DEFAULTS["target-delta"]
    target_epsilon: float | None = None
    planned_rounds: int = 50
    accountant: str = DP_DEFAULTS["accountant"]
    secure_rng: bool = DP_DEFAULTS["secure-rng"]

    def __post_init__(self) -> None:
        if not self.noise_multiplier >= 0 or math.isinf(self.noise_multiplier):
            raise ValueError(f"run config 'noise-multiplier' must be a finite number >= 0, "
                             f"got {self.noise_multiplier!r}")
        if not self.max_grad_norm > 0 or math.isinf(self.max_grad_norm):
            raise ValueError(f"run config 'max-grad-norm' must be in (0, inf), got {self.max_grad_norm!r}")
        if not 0.0 < self.target_delta < 1.0:
            raise ValueError(f"run config 'target-delta' must be in (0, 1), got {self.target_delta!r}")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"run config 'accountant' must be one of {list(ACCOUNTANTS)}, got {self.accountant!r}")
        if isinstance(self.planned_rounds, bool) or not isinstance(self.planned_rounds, int) or self.planned_rounds < 1:
            raise ValueError(f"run config 'num-server-rounds' must be an integer >= 1, got {self.planned_rounds!r}")
        if not isinstance(self.secure_rng, bool):
            raise ValueError(f"run config 'secure-rng' must be true or false, got {self.secure_rng!r}")
        if self.secure_rng and not secure_rng_available():
            raise ValueError(
                "run config 'secure-rng' = true needs Opacus' secure mode, which draws noise and "
                "Poisson samples from torchcsprng's cryptographically secure generator; the "
                "torchcsprng package is not installed here (it has no build for this PyTorch). "
                "Set secure-rng = false (seeded torch.Generator: fine for experiments, not for a "
                "production guarantee) or install torchcsprng on every client."
            )
        if self.target_epsilon is not None:
            if not self.target_epsilon > 0 or math.isinf(self.target_epsilon):
                raise ValueError(f"run config 'target-epsilon' must be in (0, inf), got {self.target_epsilon!r}")
            # The smallest epsilon any noise reaches is set by delta and the accountant, not
            # by the sample rate or the number of steps (the privacy loss of the mechanism
            # vanishes as sigma grows; what remains is the conversion to (epsilon, delta)).
            # One fully-sampled step is therefore a representative feasibility check.
            calibrate_noise_multiplier(
                target_epsilon=self.target_epsilon, target_delta=self.target_delta,
                sample_rate=1.0, steps=1, accountant=self.accountant,
            )

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> DPSGDConfig:
        """Parse and validate the DP-SGD keys of a run config (``context.run_config``).

        Reads ``noise-multiplier``, ``max-grad-norm``, ``target-delta``, ``target-epsilon``
        (absent = no calibration), ``accountant``, ``secure-rng`` and, with
        ``target-epsilon``, ``num-server-rounds``. Other keys are ignored.

        Raises
        ------
        ValueError
            A key with a wrong type or out of range (see the class docstring).
        """
        secure = DP_KEYS["secure-rng"].read(cfg)
        accountant = cfg.get("accountant", cls.accountant)
        if not isinstance(accountant, str):
            raise ValueError(f"run config 'accountant' must be a string, got {accountant!r}")
        target = cfg.get("target-epsilon")
        if target == 0:  # the app's run config uses 0 for "not set" (every key needs a default)
            target = None
        rounds = cfg.get("num-server-rounds", cls.planned_rounds)
        if isinstance(rounds, float) and rounds.is_integer():
            rounds = int(rounds)
        return cls(
            noise_multiplier=float(read_number(cfg, "noise-multiplier", cls.noise_multiplier)),
            max_grad_norm=float(read_number(cfg, "max-grad-norm", cls.max_grad_norm)),
            target_delta=float(read_number(cfg, "target-delta", cls.target_delta)),
            target_epsilon=None if target is None else float(read_number(cfg, "target-epsilon", None)),
            planned_rounds=rounds,
            accountant=accountant,
            secure_rng=secure,
        )


def planned_steps(dp_cfg: DPSGDConfig, num_examples: int, *, logical_batch: int, local_epochs: int) -> int:
    """Optimizer steps of the whole planned run on this client:
    ``planned_rounds * local_epochs * steps_per_epoch(num_examples, logical_batch)``.

    Parameters
    ----------
    dp_cfg : DPSGDConfig
        ``planned_rounds``.
    num_examples : int
        N, the client's local examples, >= 1.
    logical_batch : int
        Expected examples per optimizer step (`fedcomp.privacy.logical_batch_size`), >= 1.
    local_epochs : int
        Passes over the local data per round, >= 1.
    """
    per_epoch = steps_per_epoch(num_examples, logical_batch)
    return dp_cfg.planned_rounds * int(local_epochs) * per_epoch


def resolve_noise_multiplier(dp_cfg: DPSGDConfig, num_examples: int, *, logical_batch: int,
                             local_epochs: int) -> float:
    """The sigma this client uses: ``dp_cfg.noise_multiplier``, or with ``target_epsilon``
    the calibrated one for `planned_steps` at this client's sample rate
    ``logical_batch / num_examples``.

    Raises
    ------
    ValueError
        Unreachable target epsilon (naming ``target-epsilon``).
    """
    if dp_cfg.target_epsilon is None:
        return float(dp_cfg.noise_multiplier)
    q = sample_rate(num_examples, logical_batch)
    steps = planned_steps(dp_cfg, num_examples, logical_batch=logical_batch, local_epochs=local_epochs)
    return calibrate_noise_multiplier(
        target_epsilon=float(dp_cfg.target_epsilon), target_delta=float(dp_cfg.target_delta),
        sample_rate=q, steps=steps, accountant=dp_cfg.accountant,
    )


def projected_epsilon(dp_cfg: DPSGDConfig, num_examples: int, accountant_state: Mapping[str, Any] | None, *,
                      logical_batch: int, local_epochs: int) -> float:
    """Epsilon this client would have after one more round (at ``target_delta``), without training.

    Adds this round's steps (``local_epochs * steps_per_epoch`` at this client's sample rate and
    noise multiplier) to a copy of the restored accountant; used to refuse a round that would
    exceed a privacy budget before any data is touched. ``logical_batch`` and ``local_epochs`` as
    in `planned_steps`.
    """
    acc = restore_accountant(dp_cfg.accountant, accountant_state)
    sigma = resolve_noise_multiplier(dp_cfg, num_examples, logical_batch=logical_batch, local_epochs=local_epochs)
    q = sample_rate(num_examples, logical_batch)
    steps = int(local_epochs) * steps_per_epoch(num_examples, logical_batch)
    if sigma == 0:
        return math.inf
    acc.history.append((sigma, q, steps))
    return epsilon_spent(acc, dp_cfg.target_delta)
