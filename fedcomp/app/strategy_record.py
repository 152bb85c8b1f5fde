"""The server strategy a run resolved to, recorded in its checkpoint and checked on resume.

``strategy = "auto"`` (`fedcomp.config.low_density.resolve_strategy`) depends on the codec and on
the fedcomp version: a version without the low-density defaults resolves it to FedAvg where this one
chooses FedAvgM. A resumed run is the same run, so a strategy (or a server learning rate or
momentum) that differs from the checkpoint's is refused with both values, like the codec and privacy
settings (``check_same_codec``): the checkpoint's optimizer state and past rounds belong to its strategy,
and the run config stays what the run does (the user sets the checkpoint's values or starts a new run).
A checkpoint written before the strategy was recorded gets one WARNING saying what is assumed;
one that holds no server-optimizer state although the strategy has one is refused (it ran FedAvg).
"""

from __future__ import annotations

from logging import WARNING
from typing import Any

from flwr.common.logger import log

from fedcomp.app.config import AppConfig
from fedcomp.strategies.wrapping import optimizer_state

#: Key of `strategy_settings` in the checkpoint manifest's ``extra``.
EXTRA_KEY = "strategy-settings"


def strategy_settings(cfg: AppConfig) -> dict:
    """The resolved inner strategy and the parameters it uses: ``{"strategy"}``, plus ``"server-lr"``
    (fedadam's eta, fedavgm's server learning rate) and ``"server-momentum"`` (fedavgm)."""
    out: dict[str, Any] = {"strategy": cfg.strategy}
    if cfg.strategy in ("fedadam", "fedavgm"):
        out["server-lr"] = cfg.server_lr
    if cfg.strategy == "fedavgm":
        out["server-momentum"] = cfg.server_momentum
    return out


def _say(settings: dict) -> str:
    return ", ".join(f"{k} = {v!r}" for k, v in settings.items())


def check_same_strategy(meta: dict, cfg: AppConfig, strategy: Any, where: str) -> None:
    """Refuse a resume whose strategy settings differ from the checkpoint's; warn once for a checkpoint
    that predates them.

    Parameters
    ----------
    meta : dict
        The checkpoint manifest (`fedcomp.app.checkpoint.load`), ``extra`` holding
        `EXTRA_KEY` when it was written by this version or later.
    cfg : AppConfig
        The run config of the resumed run (strategy resolved).
    strategy : CompressedStrategy
        The run's strategy after the checkpoint was loaded into it (its server-optimizer state).
    where : str
        The checkpoint's folder, for the messages.

    Raises
    ------
    ValueError
        The recorded settings differ from `strategy_settings` (naming both), or an old checkpoint
        after round 1 or later holds no server-optimizer state while ``cfg`` resolves to a strategy
        that keeps one (that run used FedAvg).
    """
    now = strategy_settings(cfg)
    saved = meta.get("extra", {}).get(EXTRA_KEY)
    if saved is not None:
        if saved != now:
            raise ValueError(f"run config 'resume': the server strategy differs from the checkpoint's: {_say(now)} "
                             f"(checkpoint: {_say(saved)}). The checkpoint's optimizer state and past rounds belong "
                             "to its strategy: set these run-config keys to the checkpoint's values to resume, or "
                             "start a new run (another 'results-dir')")
        return
    if now["strategy"] != "fedavg" and int(meta.get("round", 0)) >= 1 and not optimizer_state(strategy):
        raise ValueError(f"run config 'resume': the checkpoint in {where} records no server strategy (written by an "
                         f"earlier fedcomp) and holds no server-optimizer state, so its run used 'fedavg'; the run "
                         f"config resolves to {_say(now)} (strategy = \"auto\" chooses server momentum at low "
                         "density since then): set strategy = \"fedavg\" to resume it, or start a new run")
    log(WARNING, "fedcomp  the checkpoint in %s records no server strategy (written by an earlier fedcomp): "
        "assuming it ran %s, what the run config resolves to now", where, _say(now))


__all__ = ["EXTRA_KEY", "check_same_strategy", "strategy_settings"]
