"""Differential privacy, Flower-free: the mechanisms, their accounting and the settings of each
DP mode.

- `mechanisms`: the Gaussian mechanism on whole updates, noise from the OS CSPRNG.
- `accounting`: Rényi DP, epsilon at delta, the DP-SGD accountant as plain data.
- `calibration`: DP-SGD's sampling arithmetic and noise calibration.
- `client_level`: client-level DP-FedAvg on the server (`ClientLevelDP`).
- `local`: local DP, clip-and-noise on each client (`LocalDP`).
- `distributed`: distributed DP under secure aggregation, the clients' Skellam noise shares
  and their RDP accountant (`DistributedDP`).
- `sample_level`: DP-SGD's settings (`DPSGDConfig`) and one client's plan (steps,
  noise multiplier, projected epsilon); the Opacus training loop is `fedcomp.privacy.dp_sgd`.

Importing this package does not import Opacus (it calls ``logging.basicConfig`` at import).
"""

from fedcomp.privacy.accounting import (
    ACCOUNTANTS,
    STATE_KEYS,
    accountant_state,
    epsilon_from_rdp,
    epsilon_spent,
    new_accountant,
    rdp_one_step,
    rdp_orders,
    restore_accountant,
)
from fedcomp.privacy.calibration import calibrate_noise_multiplier, logical_batch_size, sample_rate, steps_per_epoch
from fedcomp.privacy.client_level import NO_AMPLIFICATION, ClientLevelDP, check_accountable
from fedcomp.privacy.local import LocalDP
from fedcomp.privacy.mechanisms import clip_and_noise, clip_and_noise_, secure_generator
from fedcomp.privacy.sample_level import (
    DPSGDConfig,
    planned_steps,
    projected_epsilon,
    resolve_noise_multiplier,
    secure_rng_available,
)

__all__ = [
    "ACCOUNTANTS", "NO_AMPLIFICATION", "STATE_KEYS", "ClientLevelDP", "DPSGDConfig", "LocalDP", "accountant_state",
    "calibrate_noise_multiplier", "check_accountable", "clip_and_noise", "clip_and_noise_", "epsilon_from_rdp",
    "epsilon_spent", "logical_batch_size", "new_accountant", "planned_steps", "projected_epsilon", "rdp_one_step",
    "rdp_orders", "resolve_noise_multiplier", "restore_accountant", "sample_rate", "secure_generator",
    "secure_rng_available", "steps_per_epoch",
]
