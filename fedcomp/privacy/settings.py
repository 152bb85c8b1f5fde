"""The run-config keys of differential privacy, declared once: the mode (``dp``), the clipping and
noise of each mode, DP-SGD's accounting and the run's privacy budget.

`fedcomp.privacy.DPSGDConfig` and the reference app's ``AppConfig`` take their defaults and
checks from these declarations; `fedcomp.config.keys` gathers them with the library's other keys.
"""

from __future__ import annotations

from fedcomp.privacy.accounting import ACCOUNTANTS
from fedcomp.util.declared_key import Key, defaults, table

#: ``dp`` modes: none; sample-level DP-SGD on clients (Opacus); client-level DP-FedAvg on the
#: server; local clip + noise of each update on the client before compression; distributed DP under
#: SecAgg+ (each client clips and adds its share of Skellam noise, so the server only unmasks a noised sum).
DP_MODES = ("none", "dp-sgd", "client-level", "local", "distributed")

DP_KEYS = table(
    Key("dp", str, "none", "privacy mode: sample-level DP-SGD (Opacus, clients), client-level DP-FedAvg "
        "(server, on the decoded updates), local clip + noise (client, before compression) or distributed "
        "(secagg = true only: each client adds its share of Skellam noise, the server sees only the noised sum)",
        choices=DP_MODES),
    Key("clipping-norm", float, 1.0, "client-level / local / distributed: L2 bound of one client's update",
        lo=0.0, lo_open=True),
    Key("noise-multiplier", float, 1.0, "noise std = noise-multiplier x clipping norm (dp-sgd: x max-grad-norm)",
        lo=0.0),
    Key("max-grad-norm", float, 1.0, "dp-sgd: per-sample gradient clipping norm C", lo=0.0, lo_open=True),
    Key("target-delta", float, 1e-5, "delta at which epsilon is reported (well below 1 / local examples)",
        lo=0.0, hi=1.0, lo_open=True, hi_open=True),
    Key("target-epsilon", float, 0.0, "dp-sgd: > 0 calibrates noise-multiplier so the planned run ends at it",
        rule="0 (not set) or a number > 0"),
    Key("accountant", str, "rdp", "dp-sgd: Renyi DP (Mironov 2017) or PRV composition (Gopi et al. 2021)",
        choices=tuple(ACCOUNTANTS)),
    Key("secure-rng", bool, False, "dp-sgd: noise and Poisson samples from a CSPRNG (Opacus secure mode, "
        "needs torchcsprng)"),
    Key("max-epsilon", float, 0.0, "> 0: stop before a round would push any client past this epsilon", lo=0.0),
)
DP_DEFAULTS = defaults(DP_KEYS)

__all__ = ["DP_DEFAULTS", "DP_KEYS", "DP_MODES"]
