"""Run-config keys of secure aggregation (``secagg = true``), declared in `SECAGG_KEYS` and
validated together by `SecAggConfig` (Flower-free). ``secagg-shares`` and
``secagg-threshold`` are Flower's ``num_shares`` and ``reconstruction_threshold``: an integer
count or a float fraction, as in Flower.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedcomp.compression import CODECS, codecs_with
from fedcomp.config.codec import CODEC_DEFAULTS
from fedcomp.privacy.settings import DP_DEFAULTS
from fedcomp.util.declared_key import Key, defaults, table

#: Codecs that survive masked summation (``Compressor.secagg``): shared-seed random-k (``randomk``)
#: and dense (``none``); the sparse ones first.
SECAGG_CODECS = tuple(sorted(codecs_with(secagg=True), key=lambda name: not CODECS[name].sparse))
#: Flower's limit: ``modulus_range`` below 2**32 (its quantizer and masks use 32/64-bit integers).
MAX_MODULUS_BITS = 32
#: The largest float32: the server step times the clipping range must stay below it.
_FP32_MAX = 3.4028234663852886e38

SECAGG_KEYS = table(
    Key("secagg", bool, False, "run Flower's SecAgg+ (DefaultWorkflow + SecAggPlusWorkflow); compressor must "
        "be randomk (the round's shared seed) or none (dense); left at its default, the secure setting: randomk "
        "at density 0.07 with secagg-rotation, 3-bit quantization and secagg-server-lr 4"),
    Key("secagg-shares", float, 1.0, "Flower's num_shares: an integer > 2, or a fraction of the sampled clients",
        rule="integer > 2, or a fraction in (0, 1]"),
    Key("secagg-threshold", float, 0.7, "Flower's reconstruction_threshold: an integer < shares, or a fraction of "
        "the shares; more than half the shares (a lower one lets a curious server split a client's neighbours "
        "and unmask it)", rule="integer in (shares / 2, shares), or a fraction in (0.5, 1]"),
    Key("secagg-clipping-range", float, 1.0, "c: weighted update entries clipped to [-c, c] (error feedback keeps "
        "the rest); dp = distributed: must hold clipping-norm plus the clients' noise shares",
        rule="number > 0, c * 2**quantization-bits < 2**52"),
    Key("secagg-quantization-bits", int, 16, "Q = 2**bits levels over [-c, c]", lo=1, hi=MAX_MODULUS_BITS - 2,
        rule=f"integer in [1, {MAX_MODULUS_BITS - 2}]"),
    Key("secagg-modulus-bits", int, 0, "masks and sums live modulo 2**bits; 0 = auto per round: "
        "ceil(log2(n * Q + 1)) for n clients", lo=0, hi=MAX_MODULUS_BITS,
        rule=f"0, or an integer in (quantization-bits + 1, {MAX_MODULUS_BITS}]"),
    Key("secagg-max-weight", float, 1000.0, "Flower's max_weight: a client weighs num_examples / max_weight "
        "(must be <= 1); dp = distributed: an integer (every client's weight is exactly 1)",
        rule="number >= 1 (an integer with dp = distributed)"),
    Key("secagg-rotation", bool, False, "shared randomised Hadamard rotation before the random-k selection"),
    Key("secagg-pack", bool, True, "masked values travel packed at modulus-bits bits each instead of int64"),
    Key("secagg-server-lr", float, 1.0, "the server multiplies the decoded secure mean update by this before applying "
        "it (error feedback at a low density sends most of an update rounds later; a step above 1 makes up for "
        "that lag)", rule="number > 0, times secagg-clipping-range < 3.4e38 (float32)"),
    Key("secagg-server-lr-decay", bool, False, "secagg-server-lr falls linearly to 1 at the last round "
        "(num-server-rounds): the full step early, where error feedback lags most, FedAvg's step at the end"),
)
SECAGG_DEFAULTS: dict[str, Any] = defaults(SECAGG_KEYS)

#: What ``secagg = true`` runs when the run config leaves ``compressor`` at its declared default (a
#: codec that cannot run under SecAgg): shared-seed random-k behind the shared randomised Hadamard
#: rotation. Each key is filled only where the run config holds its declared default.
SECURE_CODEC: dict[str, Any] = {"compressor": "randomk", "density": 0.07, "secagg-rotation": True}
#: With error feedback on and no DP, also few quantization levels over a narrow range (the residual
#: keeps the rounding and clipping error, and the modulus, auto, shrinks with the levels: 7 bits for
#: 10 clients, 0.497 bits per parameter at density 0.07) and a server step of 4: error feedback at
#: this density sends most of an update rounds later, and the larger step makes up for that lag
#: (docs/benchmarks/secagg.md: within 1 point of fp32 FedAvg in 50 rounds, where step 1 is 3 below).
SECURE_QUANTIZATION: dict[str, Any] = {"secagg-quantization-bits": 3, "secagg-clipping-range": 0.05,
                                       "secagg-server-lr": 4.0}


def allows_split(threshold: int, num_shares: int) -> bool:
    """Whether a SecAgg+ reconstruction ``threshold`` of ``num_shares`` lets a server rebuild both
    secrets of one client (its mask seed from some neighbours, its key from the others): true when
    ``2 * threshold <= num_shares`` (Bell et al., CCS 2020, SecAgg+ needs ``t > n / 2`` against a
    server that lies about who dropped)."""
    return 2 * int(threshold) <= int(num_shares)


def majority_threshold(num_shares: int) -> int:
    """The smallest threshold that `allows_split` refuses: ``num_shares // 2 + 1``."""
    return int(num_shares) // 2 + 1


def _number(cfg: Mapping[str, Any], key: str) -> float | int:
    v = cfg.get(key, SECAGG_DEFAULTS[key])
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"run config '{key}' must be a finite number, got {v!r}")
    return v


def _int(cfg: Mapping[str, Any], key: str) -> int:
    lo, hi = SECAGG_KEYS[key].lo, SECAGG_KEYS[key].hi
    v = _number(cfg, key)
    if isinstance(v, float) and not v.is_integer() or not lo <= v <= hi:
        raise ValueError(f"run config '{key}' must be an integer in [{lo}, {hi}], got {v!r}")
    return int(v)


@dataclass(frozen=True)
class SecAggConfig:
    """SecAgg+ settings of a run; see `SECAGG_KEYS` for each key (``secagg-<field>``,
    ``secagg`` for ``enabled``)."""

    enabled: bool = SECAGG_DEFAULTS["secagg"]
    shares: int | float = SECAGG_DEFAULTS["secagg-shares"]
    threshold: int | float = SECAGG_DEFAULTS["secagg-threshold"]
    clipping_range: float = SECAGG_DEFAULTS["secagg-clipping-range"]
    quantization_bits: int = SECAGG_DEFAULTS["secagg-quantization-bits"]
    modulus_bits: int = SECAGG_DEFAULTS["secagg-modulus-bits"]
    max_weight: float = SECAGG_DEFAULTS["secagg-max-weight"]
    rotation: bool = SECAGG_DEFAULTS["secagg-rotation"]
    pack: bool = SECAGG_DEFAULTS["secagg-pack"]
    server_lr: float = SECAGG_DEFAULTS["secagg-server-lr"]
    server_lr_decay: bool = SECAGG_DEFAULTS["secagg-server-lr-decay"]

    @property
    def quantization_range(self) -> int:
        """Q = 2**quantization_bits."""
        return 1 << self.quantization_bits

    @classmethod
    def from_run_config(cls, cfg: Mapping[str, Any]) -> SecAggConfig:
        """Parse and validate the ``secagg*`` keys (other keys are ignored), after
        `resolve_secure_defaults`; with ``secagg = false`` too (a bad key is named, never ignored).

        Raises
        ------
        ValueError
            Naming the key and its allowed range.
        """
        cfg = resolve_secure_defaults(cfg)
        shares, threshold = _number(cfg, "secagg-shares"), _number(cfg, "secagg-threshold")
        if isinstance(shares, int) and shares not in (1,) and shares <= 2:
            raise ValueError(f"run config 'secagg-shares' as an integer must be > 2 (or a fraction in (0, 1]), "
                             f"got {shares}")
        if isinstance(shares, float) and not 0 < shares <= 1:
            raise ValueError(f"run config 'secagg-shares' as a float is a fraction of the sampled clients in (0, 1], "
                             f"got {shares}")
        if isinstance(threshold, float) and not 0 < threshold <= 1:
            raise ValueError(f"run config 'secagg-threshold' as a float is a fraction of the shares in (0, 1], "
                             f"got {threshold}")
        if isinstance(threshold, int) and (threshold < 1 or isinstance(shares, int) and shares > 1
                                           and threshold >= shares):
            raise ValueError(f"run config 'secagg-threshold' as an integer must be >= 1 and < 'secagg-shares', "
                             f"got {threshold}")
        if isinstance(threshold, float) and threshold <= 0.5 or (
                isinstance(threshold, int) and threshold > 1 and isinstance(shares, int) and shares > 1
                and allows_split(threshold, shares)):
            raise ValueError(f"run config 'secagg-threshold' = {threshold!r} allows at most half of the "
                             f"'secagg-shares' = {shares!r}: a curious server could ask half of a client's neighbours "
                             "for its mask seed and the other half for its key and unmask that one client. It must "
                             "be more than half the shares: a fraction > 0.5, or an integer > secagg-shares / 2")
        c = float(_number(cfg, "secagg-clipping-range"))
        if c <= 0:
            raise ValueError(f"run config 'secagg-clipping-range' must be > 0, got {c}")
        qbits = _int(cfg, "secagg-quantization-bits")
        if c * 2.0 ** qbits >= 2.0 ** 52:
            raise ValueError(f"run config 'secagg-clipping-range' = {c:g} is too large for "
                             f"secagg-quantization-bits = {qbits}: c * 2**bits must stay < 2**52 (what float64 "
                             "resolves); the rounding noise per value is ~c / 2**bits, so pick c near the largest "
                             "update entry")
        mbits = _int(cfg, "secagg-modulus-bits")
        if mbits and mbits <= qbits + 1:
            raise ValueError(f"run config 'secagg-modulus-bits' = {mbits} must exceed secagg-quantization-bits + 1 "
                             f"= {qbits + 1} (the sum of two clients already needs {qbits + 2} bits), or be 0 (auto)")
        mw = float(_number(cfg, "secagg-max-weight"))
        if mw < 1:
            raise ValueError(f"run config 'secagg-max-weight' must be >= 1 (a client's count of examples), got {mw}")
        server_lr = float(_number(cfg, "secagg-server-lr"))
        if server_lr <= 0:
            raise ValueError(f"run config 'secagg-server-lr' must be > 0 (it scales the decoded secure mean update), "
                             f"got {server_lr:g}")
        if server_lr * c >= _FP32_MAX:
            raise ValueError(f"run config 'secagg-server-lr' = {server_lr:g} times secagg-clipping-range = {c:g} (the "
                             "largest entry of the decoded mean update) overflows a float32 model (3.4e38): every "
                             "round would be refused; a step above 1 only makes up for error feedback's lag")
        flags = {k: SECAGG_KEYS[k].read(cfg) for k in ("secagg", "secagg-rotation", "secagg-pack",
                                                        "secagg-server-lr-decay")}
        return cls(enabled=flags["secagg"], shares=shares, threshold=threshold, clipping_range=c,
                   quantization_bits=qbits, modulus_bits=mbits, max_weight=mw,
                   rotation=flags["secagg-rotation"], pack=flags["secagg-pack"], server_lr=server_lr,
                   server_lr_decay=flags["secagg-server-lr-decay"])


def _declared_default(key: str) -> Any:
    return SECAGG_DEFAULTS[key] if key in SECAGG_DEFAULTS else CODEC_DEFAULTS[key]


def secure_defaults(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """The settings ``secagg = true`` fills in when ``compressor`` is at its declared default.

    Flower's run config holds every key, so "left alone" means "equal to the declared default":
    with ``secagg = true`` and ``compressor`` at its default, each key of `SECURE_CODEC`
    (and, with ``error-feedback = true`` and ``dp = "none"``, of `SECURE_QUANTIZATION`)
    that holds its declared default takes the secure value. A run config that names a codec
    (``compressor = "randomk"`` or ``"none"``) keeps every key as given.

    Parameters
    ----------
    run_config : Mapping
        Flower's run config (a missing key counts as its declared default).

    Returns
    -------
    dict
        Key -> the value chosen (empty when nothing is filled in).
    """
    if run_config.get("secagg", False) is not True:
        return {}
    if run_config.get("compressor", CODEC_DEFAULTS["compressor"]) != CODEC_DEFAULTS["compressor"]:
        return {}
    chosen = dict(SECURE_CODEC)
    if (run_config.get("error-feedback", CODEC_DEFAULTS["error-feedback"]) is True
            and run_config.get("dp", DP_DEFAULTS["dp"]) == "none"):
        chosen.update(SECURE_QUANTIZATION)
    return {k: v for k, v in chosen.items() if k == "compressor" or _left_alone(run_config, k)}


def _left_alone(run_config: Mapping[str, Any], key: str) -> bool:
    """``key`` holds its declared default (missing counts as it): equal *and* a bool exactly when the
    default is one, so ``true`` for a number key (``True == 1.0`` in Python) or ``0`` for a flag stays
    as given and is refused by the key's own check instead of silently becoming the secure value."""
    d = _declared_default(key)
    v = run_config.get(key, d)
    return isinstance(v, bool) == isinstance(d, bool) and v == d


def resolve_secure_defaults(run_config: Mapping[str, Any]) -> Mapping[str, Any]:
    """``run_config`` with `secure_defaults` applied (a new dict), or ``run_config`` itself when
    nothing is filled in; applying it twice changes nothing."""
    chosen = secure_defaults(run_config)
    return {**run_config, **chosen} if chosen else run_config


def secure_defaults_note(run_config: Mapping[str, Any]) -> str:
    """The INFO line the server logs when `secure_defaults` chose settings ("" otherwise)."""
    chosen = secure_defaults(run_config)
    if not chosen:
        return ""
    shown = ", ".join(f"{k} = {v!r}" if isinstance(v, str) else f"{k} = {v:g}" if not isinstance(v, bool)
                      else f"{k} = {str(v).lower()}" for k, v in chosen.items())
    return (f"secagg = true with compressor at its default ({CODEC_DEFAULTS['compressor']!r}, which cannot run "
            f"under SecAgg): chose {shown}; set compressor = 'randomk' (or 'none': dense) and the secagg-* keys "
            "to choose otherwise")


def check_codec_under_secagg(run_config: Mapping[str, Any]) -> None:
    """Refuse run-config settings that cannot work when the server only sees a masked sum.

    Raises
    ------
    ValueError
        A codec other than `SECAGG_CODECS` (its per-client positions or scales make a
        masked sum meaningless; ``compressor`` at its declared default is resolved first, see
        `secure_defaults`), a non-integer ``secagg-max-weight`` with ``dp = "distributed"``, or a
        feature the secure path does not implement (naming it).
    """
    run_config = resolve_secure_defaults(run_config)
    comp = run_config.get("compressor", CODEC_DEFAULTS["compressor"])
    if comp not in SECAGG_CODECS:
        raise ValueError(f"run config 'compressor' = {comp!r} cannot work under secure aggregation: the server only "
                         f"sees the masked sum, and {comp!r} chooses positions or scales per client. Use one of "
                         f"{list(SECAGG_CODECS)} ('randomk' uses the round's shared seed, 'none' is dense SecAgg+)")
    ef = run_config.get("error-feedback", CODEC_DEFAULTS["error-feedback"])
    if ef not in (True, False):
        raise ValueError(f"run config 'error-feedback' = {run_config['error-feedback']!r} is not supported with "
                         "secagg = true (use true or false: the server only sees the masked sum, not each client's "
                         "EF21 estimate)")
    dp = run_config.get("dp", DP_DEFAULTS["dp"])
    if dp not in ("none", "client-level", "distributed"):
        raise ValueError(f"run config 'dp' = {dp!r} is not supported with secagg = true (use 'none', 'client-level': "
                         "clients clip their shared k values, the server adds the noise to the sum, or 'distributed': "
                         "clients clip and add their shares of the noise)")
    mw = run_config.get("secagg-max-weight", SECAGG_DEFAULTS["secagg-max-weight"])
    if dp == "distributed" and isinstance(mw, (int, float)) and not float(mw).is_integer():
        raise ValueError(f"run config 'secagg-max-weight' = {mw!r} must be an integer with dp = 'distributed': each "
                         "client reports it as its weight, which must be exactly 1 for its noise share to stay on "
                         "SecAgg+'s grid")
    if dp in ("client-level", "distributed") and ef is not False:
        raise ValueError(f"run config dp = {dp!r} with secagg = true needs error-feedback = false: with error "
                         "feedback the residual carries the clipped excess into later rounds and voids the clipping "
                         "bound")
    unsupported = {"downstream-correction": "off", "client-sampling": "fraction",
                   "layer-codecs": "", "warmup-rounds": 0, "density-schedule": "constant",
                   "momentum-correction": 0.0, "resume": False,
                   # the secure path trains the full model and encodes every float entry with the shared seed:
                   "finetune": "full", "selection": "auto", "min-compress-numel": 0,
                   "small-tensor-compressor": "none", "require-compression": False}
    if run_config.get("batchnorm-stats") == "codec":  # the aggregate clamps variances at 0: int8 steps go below
        raise ValueError("run config 'batchnorm-stats' = 'codec' is not supported with secagg = true (use 'auto' or "
                         "'small')")
    for key, ok in unsupported.items():
        if key in run_config and run_config[key] != ok and not (key in ("density-schedule", "downstream-correction")
                                                                 and run_config[key] == "auto"):
            raise ValueError(f"run config '{key}' = {run_config[key]!r} is not supported with secagg = true "
                             f"(use {ok!r})")
