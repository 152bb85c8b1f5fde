"""Which run-config keys exist: every key a fedcomp app reads, and the refusal of any other key
(naming the closest valid one, so that a misspelt key is not silently ignored)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedcomp.util.validate import closest_hint
from fedcomp.config.codec import CODEC_DEFAULTS

#: Run-config keys fedcomp's own ServerApp and ClientApp read besides :data:`CODEC_DEFAULTS`
#: (the DP-SGD ones are read by ``fedcomp.privacy.DPSGDConfig``). Together they are exactly
#: the keys of ``[tool.flwr.app.config]`` in ``pyproject.toml`` (a test holds that): a new key
#: goes into both, with its default in one place.
APP_KEYS: tuple[str, ...] = (
    "num-server-rounds", "fraction-train", "fraction-evaluate", "client-sampling", "min-train-nodes",
    "min-available-nodes", "round-timeout", "strategy", "server-lr", "server-momentum", "downstream",
    "uplink-mbps", "downlink-mbps", "dp", "clipping-norm", "noise-multiplier", "max-grad-norm", "target-delta",
    "target-epsilon", "accountant", "secure-rng", "max-epsilon", "lr", "momentum", "local-epochs", "batch-size",
    "accumulation-steps", "local-clip-norm", "seed", "dataset", "model", "partitioner", "dirichlet-alpha",
    "results-dir", "resume", "client-state-dir", "optimizer", "adam-beta1", "adam-beta2", "weight-decay", "precision",
    "verbose", "require-compression",
)


def run_config_keys() -> frozenset[str]:
    """Every run-config key fedcomp's apps know: :data:`APP_KEYS`, :data:`CODEC_DEFAULTS`, the
    ``secagg*`` keys of :data:`fedcomp.config.secagg.SECAGG_DEFAULTS` and the LoRA keys of
    :data:`fedcomp.task.lora.LORA_DEFAULTS`."""
    from fedcomp.task.lora import LORA_DEFAULTS
    from fedcomp.config.secagg import SECAGG_DEFAULTS  # here: fedcomp.secagg imports Flower

    return frozenset(APP_KEYS) | frozenset(CODEC_DEFAULTS) | frozenset(SECAGG_DEFAULTS) | frozenset(LORA_DEFAULTS)


def check_known_keys(cfg: Mapping[str, Any], known: frozenset[str] | None = None, source: str = "run config") -> None:
    """Refuse keys no fedcomp app reads, naming the closest valid one (a misspelt ``densty = 0.05``
    would otherwise be ignored silently and the default used).

    Parameters
    ----------
    cfg : Mapping[str, Any]
        A run config (``context.run_config``, or the overrides of ``--run-config``).
    known : frozenset[str], optional
        The valid keys; default :func:`run_config_keys`.
    source : str
        What ``cfg`` is, for the message.

    Raises
    ------
    ValueError
        ``run config key 'densty' is unknown; did you mean 'density'?`` (for the first unknown key in
        sorted order; the closest name by ``difflib`` similarity >= 0.6, else no suggestion).
    """
    known = run_config_keys() if known is None else known
    unknown = sorted(k for k in cfg if k not in known)
    if unknown:
        raise ValueError(unknown_key_message(unknown[0], known, source))


def unknown_key_message(key: str, known, source: str = "run config") -> str:
    """``"run config key 'densty' is unknown; did you mean 'density'?"`` (one line)."""
    return (f"{source} key '{key}' is unknown; {closest_hint(key, known)} (every key, with its default, is in "
            "[tool.flwr.app.config] of pyproject.toml)")


__all__ = ["APP_KEYS", "check_known_keys", "run_config_keys", "unknown_key_message"]
