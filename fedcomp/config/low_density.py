"""Defaults for the sparsifying codecs at low density: the run-config value "auto".

``density-schedule = "auto"`` and ``strategy = "auto"`` (the defaults) are resolved from the codec
settings alone: for ``stc`` or ``topk`` at a density below `LOW_DENSITY` (1/400) with
classic error feedback,

- DGC's warm-up (Lin et al., "Deep Gradient Compression", ICLR 2018, section 3.3): the density
  falls exponentially from ``density-start`` (0.25) to ``density`` over the first
  ``schedule-rounds`` rounds (default 30; "exponential");
- server momentum (FedAvgM, Hsu et al., "Measuring the Effects of Non-Identical Data
  Distribution for Federated Visual Classification", 2019) with server learning rate
  `AUTO_SERVER_LR` and momentum `AUTO_SERVER_MOMENTUM` (not the run config's
  ``server-lr``/``server-momentum``, whose defaults are FedAdam's eta and a FedAvgM momentum
  of 0.9), unless DGC's momentum correction, EF21 or DP is on, or ``warmup-rounds`` is set
  (the user's own warm-up replaces DGC's, and "auto" adds server momentum only together with
  DGC's warm-up).

Everywhere else "auto" is "constant" and "fedavg". The decision depends on the codec, the
density and the error-feedback mode, not on the model. ``benchmarks/federated.py --suite
accuracy`` compares these settings with the plain ones (docs/benchmarks/accuracy.md, "Accuracy per byte on BatchNorm
models and at 1/1000").
"""

from __future__ import annotations

from typing import Any, Mapping

from fedcomp.compression import codecs_with

#: "auto" applies below this density (exclusive); at 1/400 and above it keeps the plain settings.
LOW_DENSITY = 0.0025
#: Codecs whose k largest entries DGC's warm-up was designed for (``Compressor.density_ramp``).
RAMP_CODECS = codecs_with(density_ramp=True)
#: FedAvgM's server learning rate and momentum under ``strategy = "auto"`` at low density.
AUTO_SERVER_LR = 1.0
AUTO_SERVER_MOMENTUM = 0.5


def is_low_density(compressor: str, density: float, error_feedback: bool | str) -> bool:
    """True where "auto" turns the warm-up on: ``compressor`` in `RAMP_CODECS`, ``density``
    (fraction of entries kept, in (0, 1]) below `LOW_DENSITY`, classic error feedback."""
    return compressor in RAMP_CODECS and density < LOW_DENSITY and error_feedback is True


def resolve_schedule(requested: str, compressor: str, density: float, error_feedback: bool | str,
                     warmup_rounds: int) -> str:
    """``density-schedule``: "auto" becomes "exponential" at low density (no ``warmup-rounds``:
    a warm-up codec is the user's own warm-up), else "constant"; other values stay."""
    if requested != "auto":
        return requested
    return "exponential" if is_low_density(compressor, density, error_feedback) and not warmup_rounds else "constant"


def resolve_strategy(requested: str, server_lr: float, server_momentum: float, codec: Any,
                     dp: str) -> tuple[str, float, float]:
    """``strategy``: "auto" becomes FedAvgM (`AUTO_SERVER_LR`, `AUTO_SERVER_MOMENTUM`)
    at low density without momentum correction, DP or ``warmup-rounds``, else "fedavg".

    "auto" adds server momentum only together with DGC's density warm-up; ``warmup-rounds`` > 0
    (the user's own warm-up codec) turns that warm-up off (`resolve_schedule`), so "auto"
    then gives FedAvg for both.

    Returns
    -------
    (strategy, server_lr, server_momentum)
        Other values of ``requested`` come back with ``server_lr``/``server_momentum`` unchanged.
    """
    if requested != "auto":
        return requested, server_lr, server_momentum
    if is_low_density(codec.compressor, codec.density, codec.error_feedback) and not codec.momentum_correction \
            and dp == "none" and not codec.warmup_rounds:
        return "fedavgm", AUTO_SERVER_LR, AUTO_SERVER_MOMENTUM
    return "fedavg", server_lr, server_momentum


def auto_note(run_config: Mapping[str, Any], cfg: Any) -> str:
    """The line the server logs once when "auto" chose a low-density setting ("" otherwise).

    Parameters
    ----------
    run_config : Mapping
        The run config as given (a key it lacks counts as "auto", its default).
    cfg : fedcomp.app.config.AppConfig
        The parsed (resolved) configuration.
    """
    parts = []
    codec = cfg.codec
    if run_config.get("density-schedule", "auto") == "auto" and codec.density_schedule != "constant":
        parts.append(f"density warm-up {codec.density_start:g} -> {codec.density:g} (exponential, "
                     f"{codec.schedule_rounds} rounds)")
    if run_config.get("strategy", "auto") == "auto" and cfg.strategy != "fedavg":
        parts.append(f"server momentum (fedavgm, server-lr {cfg.server_lr:g}, server-momentum {cfg.server_momentum:g})")
    if not parts:
        return ""
    return (f"{codec.compressor} at density {codec.density:g} (< {LOW_DENSITY:g}): 'auto' defaults chose "
            + " and ".join(parts) + "; set density-schedule = \"constant\" / strategy = \"fedavg\" to turn them off")


def short_ramp_note(cfg: Any) -> str:
    """A warning ("" if none) when the density schedule (after ``warmup-rounds``) is longer than the run: its
    last round still sends more than the requested ``density`` (e.g. 3 rounds of a 30-round ramp from 0.25
    end at ~0.17), or ``warmup-rounds`` covers the whole run (the codec never runs).

    Parameters
    ----------
    cfg : fedcomp.app.config.AppConfig
        The parsed (resolved) configuration (``num_server_rounds``, ``codec.schedule_rounds``, ...).
    """
    codec, rounds = cfg.codec, cfg.num_server_rounds
    if codec.warmup_rounds >= rounds:
        return (f"warmup-rounds = {codec.warmup_rounds} covers all num-server-rounds = {rounds}: every round sends "
                f"{codec.warmup_compressor!r}, {codec.compressor!r} never runs; set warmup-rounds < num-server-rounds")
    last = codec.scheduled_density(rounds)
    if last == codec.density:
        return ""
    takes = (f"warmup-rounds + schedule-rounds = {codec.warmup_rounds} + {codec.schedule_rounds} rounds"
             if codec.warmup_rounds else f"schedule-rounds = {codec.schedule_rounds} rounds")
    return (f"density-schedule {codec.density_schedule!r} takes {takes}, "
            f"more than num-server-rounds = {rounds}: the last round sends density {last:.4g}, "
            f"not {codec.density:g}; set schedule-rounds <= num-server-rounds or density-schedule = \"constant\"")


def check_ramp_direction(codec: Any) -> None:
    """Refuse a density schedule that would raise the density: DGC's warm-up falls from ``density-start``
    to ``density`` (a ``density-start`` below ``density`` sends ever more entries, never what was asked
    at the start).

    Raises
    ------
    ValueError
        ``density-schedule`` (resolved) is "exponential" or "linear" and ``density-start`` < ``density``.
    """
    if codec.density_schedule in ("exponential", "linear") and codec.density_start < codec.density:
        raise ValueError(f"run config 'density-start' ({codec.density_start:g}) is below 'density' "
                         f"({codec.density:g}): density-schedule {codec.density_schedule!r} falls from density-start "
                         "to density over schedule-rounds rounds (DGC's warm-up); set density-start >= density or "
                         "density-schedule = \"constant\"")


__all__ = ["AUTO_SERVER_LR", "AUTO_SERVER_MOMENTUM", "LOW_DENSITY", "RAMP_CODECS", "auto_note", "check_ramp_direction",
           "is_low_density", "resolve_schedule", "resolve_strategy", "short_ramp_note"]
