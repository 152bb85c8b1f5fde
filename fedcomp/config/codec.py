"""The codec a client uses and how (`CodecConfig`): every codec key of the run config with
its one default, its checks, the per-layer rules and the density schedule of the rounds.

The codec fields (``density``, ``levels``, ``rank``, ...) come from the codecs' own option
declarations (``Compressor.options``): a codec takes its constructor arguments from them, and
`CodecConfig.build` knows no codec by name.
"""

from __future__ import annotations

import fnmatch
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from fedcomp.compression import CODECS, Compressor, available_compressors, codec_options, codecs_with
from fedcomp.compression.dense import SMALL_TENSOR
from fedcomp.compression.error_feedback import check_error_feedback
from fedcomp.config.low_density import resolve_schedule
from fedcomp.util.declared_key import Key, defaults, table
from fedcomp.util.validate import closest_hint, read_string

#: Codecs that choose entries (their k is taken over the whole model with selection "auto"):
#: ``Compressor.sparse``.
SPARSE_CODECS = codecs_with(sparse=True)
#: Codec of each BatchNorm statistic's change under ``batchnorm-stats = "auto"`` (both ways): a
#: scaled sign, 1 bit per entry and one fp32 scale per tensor (Karimireddy et al., ICML 2019, with
#: error feedback), so the mean's and the variance's changes keep their own scale.
BATCHNORM_STATS_CODEC = "sign"
DENSITY_SCHEDULES = ("auto", "constant", "exponential", "linear", "adaptive")
#: Codecs that work per tensor only ("selection" must resolve to "tensor"): ``Compressor.per_tensor_only``.
TENSOR_ONLY_CODECS = codecs_with(per_tensor_only=True)

#: The codec policy keys (which codec, error feedback, scope, per-layer rules, schedules), each declared
#: once (sent to the clients in the train config; a node config may override them); the codec options
#: (``density``, ``levels``, ...) are declared by the codecs (``Compressor.options``).
POLICY_KEYS: dict[str, Key] = table(
    Key("compressor", str, "stc", "codec of the client updates", choices=available_compressors),
    Key("error-feedback", bool, True, "keep what the codec did not send and add it to the next update "
        "(true), no memory (false), or EF21's estimate (ef21)", rule="true, false or `\"ef21\"`"),
    Key("residual-dtype", str, "fp32", "storage type of the error-feedback residual (fp16 halves its memory)",
        choices=("fp32", "fp16")),
    Key("selection", str, "auto", "scope a codec works on: one payload per tensor or the whole model; auto: "
        "model for the sparsifying codecs, else tensor", choices=("auto", "tensor", "model")),
    Key("min-compress-numel", int, 0, "tensors with fewer elements use small-tensor-compressor; 0 = off", lo=0),
    SMALL_TENSOR,
    Key("batchnorm-stats", str, "auto", "BatchNorm running mean/var: auto: their change as a scaled sign per "
        "tensor with error feedback, both ways (up only with a lossy codec and classic error feedback); "
        "running_var at most halved per exchange; small: small-tensor-compressor up, exact down; codec: "
        "like any tensor", choices=("auto", "small", "codec")),
    Key("batchnorm-affine", str, "codec", "BatchNorm weight/bias: the codec, or small-tensor-compressor (small) "
        "with the sparsifying codecs", choices=("small", "codec")),
    Key("layer-codecs", str, "", "per-layer codecs, first matching rule wins; empty: compressor everywhere",
        rule="comma-separated `pattern=codec` rules, shell wildcards on parameter names"),
    Key("warmup-rounds", int, 0, "first rounds sent with warmup-compressor", lo=0),
    Key("warmup-compressor", str, "none", "codec of the warm-up rounds", choices=available_compressors),
    Key("density-schedule", str, "auto", "density over the rounds; auto: exponential for stc/topk with error "
        "feedback below density 1/400 and no warm-up rounds, else constant", choices=DENSITY_SCHEDULES),
    Key("density-start", float, 0.25, "first density of an exponential or linear schedule",
        lo=0.0, hi=1.0, lo_open=True),
    Key("schedule-rounds", int, 30, "rounds from density-start to density", lo=1),
    Key("target-error", float, 0.5, "adaptive schedule: largest relative compression error allowed",
        lo=0.0, hi=1.0, lo_open=True),
    Key("density-min", float, 0.001, "adaptive schedule: smallest density tried (at most density-max)",
        lo=0.0, hi=1.0, lo_open=True),
    Key("density-max", float, 0.25, "adaptive schedule: largest density tried", lo=0.0, hi=1.0, lo_open=True),
    Key("momentum-correction", float, 0.0, "DGC's momentum correction beta for the sparsifying codecs "
        "(needs error-feedback = true); 0 = off", lo=0.0, hi=1.0, hi_open=True),
)


def _default(key: str) -> Any:
    return POLICY_KEYS[key].default


def parse_layer_codecs(spec: str) -> list[tuple[str, str]]:
    """Parse ``layer-codecs`` rules: ``"conv*=int8, fc2.*=sign"`` -> [("conv*", "int8"), ("fc2.*", "sign")].

    Patterns are shell-style wildcards matched against full parameter names (``fnmatch``:
    ``*`` any characters, ``?`` one, ``[ab]`` a set); the first matching rule wins.

    Raises
    ------
    ValueError
        A rule without "=", an empty pattern, or an unknown codec name (naming the rule).
    """
    rules = []
    for raw in (r.strip() for r in spec.split(",")):
        if not raw:
            continue
        pattern, sep, codec = (x.strip() for x in raw.partition("="))
        if not sep or not pattern:
            raise ValueError(f"run config 'layer-codecs': rule {raw!r} must look like 'pattern=codec'")
        if codec not in available_compressors():
            raise ValueError(f"run config 'layer-codecs': rule {raw!r} names unknown codec {codec!r}; "
                             f"choose one of {available_compressors()}")
        rules.append((pattern, codec))
    return rules


def _error_feedback(cfg: Mapping[str, Any], source: str) -> bool | str:
    """``error-feedback``: true (classic residual), false, or "ef21" (Richtárik et al. 2021)."""
    value = cfg.get("error-feedback", _default("error-feedback"))
    if value == "ef21" or isinstance(value, bool):
        return value
    raise ValueError(f"{source} 'error-feedback' must be true, false or \"ef21\", got {value!r}")


def _layer_codecs(cfg: Mapping[str, Any], source: str) -> str:
    """``layer-codecs`` as a string (its rules are checked by `parse_layer_codecs`)."""
    return read_string(cfg, "layer-codecs", _default("layer-codecs"), src=source)


#: Readers of the policy keys whose rule a `Key` cannot state.
_RULE_READS = {"error-feedback": _error_feedback, "layer-codecs": _layer_codecs}


def _with_codec_options(cls: type) -> type:
    """Give ``cls`` a field for every registered codec option it does not declare itself (right after
    ``compressor``, default the option's), then make it a frozen dataclass."""
    own = dict(inspect.get_annotations(cls))
    codec_fields = {}
    for opt in codec_options().values():
        if opt.field not in own:
            codec_fields[opt.field] = opt.type.__name__
            setattr(cls, opt.field, opt.default)
    first = next(iter(own))
    cls.__annotations__ = {first: own.pop(first), **codec_fields, **own}
    return dataclass(frozen=True)(cls)


@_with_codec_options
class CodecConfig:
    """Which codec a client uses and how: the keys of `CODEC_DEFAULTS` (the fields below, with
    ``-`` for ``_``; each field's default is the key's default).

    ``selection`` is the scope a codec works on: "tensor" (one payload per parameter
    tensor) or "model" (the whole flattened update as one payload, so top-k/STC pick their
    k entries over the whole model). "auto" (default) is "model" for stc/topk/randomk and
    "tensor" for the rest (sign keeps one scale per tensor); ``benchmarks/federated.py`` runs
    rows with the other scope ("stc 0.0025+EF tensor", "sign+EF model-scale").

    ``error-feedback``: true (classic error feedback: send ``C(update + residual)``, keep the
    residual), false, or "ef21" (Richtárik et al. 2021: send ``C(update - h)``; client and server
    both add the decoded send to their estimate h and the server applies its h; needs a
    weighted-mean inner strategy and no client-level DP).

    Per-layer policy: ``layer-codecs`` rules (first match wins) give some parameters their
    own codec; parameters with fewer than ``min-compress-numel`` elements use
    ``small-tensor-compressor`` ("none" or "fp16"); the rest use ``compressor``. BatchNorm's
    statistics (tensors named ``*.running_mean`` / ``*.running_var``): with ``batchnorm-stats =
    "auto"`` (the default) each travels as its own ``sign`` payload (1 bit per entry and one
    scale per tensor) with error feedback whenever the update codec is lossy with classic error
    feedback and no momentum correction (`batchnorm_stats_codec`), and the server clamps an
    aggregated running variance at 0; the download sends each node their change since its copy
    the same way (`fedcomp.download.sender`). ``"small"`` sends them with
    ``small-tensor-compressor`` up and exactly down (a lossy codec without the clamp can push a
    running variance below zero, which turns every later output into NaN); ``"codec"`` sends them
    like any other tensor. BatchNorm's
    affine parameters (``<bn>.weight`` / ``<bn>.bias``) go there too with stc/topk/randomk when
    ``batchnorm-affine = "small"`` (default "codec"; see `fedcomp.config.model_policy`).
    Schedules (applied by the server each round): ``warmup-rounds`` rounds with
    ``warmup-compressor``, then ``density-schedule`` "auto" (the default: "exponential" for
    stc/topk with classic error feedback below density 1/400, else "constant"; `fedcomp.config.low_density`),
    "constant", "exponential" or "linear"
    from ``density-start`` to ``density`` over ``schedule-rounds`` rounds (DGC's warm-up,
    Lin et al. ICLR 2018), or "adaptive": each client picks the smallest density in
    [``density-min``, ``density-max``] whose relative compression error on its current
    update is at most ``target-error``.

    Codec options (fields declared by the codecs, ``Compressor.options``): ``density``, ``levels``,
    ``block-size``, ``value-dtype``, ``rank`` (powersgd, r >= 1), ``unbiased`` (eden: DRIVE's
    unbiased scale instead of the least-squares one), ``spacing`` (qsgd: "uniform" or NUQSGD's
    "exponential", which takes at most 126 levels), and those of any other registered codec.
    ``momentum-correction`` (DGC's beta in [0, 1), 0 = off:
    the client accumulates u <- beta u + update and sends the sparsified residual of u; it
    needs ``error-feedback``). PowerSGD is per tensor ("auto" selection gives "tensor", "model"
    is refused) and needs error feedback (it is biased; its warm-start Q is kept with the
    residual); tensors where low rank does not pay go through ``small-tensor-compressor``.
    """

    compressor: str = _default("compressor")
    error_feedback: bool | str = _default("error-feedback")
    residual_dtype: str = _default("residual-dtype")
    selection: str = _default("selection")
    min_compress_numel: int = _default("min-compress-numel")
    small_tensor_compressor: str = _default("small-tensor-compressor")
    batchnorm_stats: str = _default("batchnorm-stats")
    batchnorm_affine: str = _default("batchnorm-affine")
    layer_codecs: str = _default("layer-codecs")
    warmup_rounds: int = _default("warmup-rounds")
    warmup_compressor: str = _default("warmup-compressor")
    density_schedule: str = _default("density-schedule")
    density_start: float = _default("density-start")
    schedule_rounds: int = _default("schedule-rounds")
    target_error: float = _default("target-error")
    density_min: float = _default("density-min")
    density_max: float = _default("density-max")
    momentum_correction: float = _default("momentum-correction")

    def __post_init__(self) -> None:
        # "auto": DGC's warm-up for stc/topk below 1/400, else constant (fedcomp.config.low_density)
        object.__setattr__(self, "density_schedule", resolve_schedule(
            self.density_schedule, self.compressor, self.density, self.error_feedback, self.warmup_rounds))

    def batchnorm_stats_codec(self) -> str | None:
        """The codec of each BatchNorm statistic's own upload payload: ``small-tensor-compressor``
        under ``batchnorm-stats = "small"``, ``"sign"`` under "auto" with a lossy ``compressor``,
        classic error feedback and no momentum correction (else "auto" is "small"); None under
        "codec" (they go with the other tensors)."""
        if self.batchnorm_stats == "codec":
            return None
        if (self.batchnorm_stats == "auto" and self.compressor != "none" and self.error_feedback is True
                and not self.momentum_correction):
            return BATCHNORM_STATS_CODEC
        return self.small_tensor_compressor

    @property
    def scope(self) -> str:
        """The resolved selection scope, "tensor" or "model"."""
        if self.selection != "auto":
            return self.selection
        return "model" if CODECS[self.compressor].sparse else "tensor"

    @property
    def rules(self) -> list[tuple[str, str]]:
        """Parsed ``layer-codecs`` rules."""
        return parse_layer_codecs(self.layer_codecs)

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any], source: str = "run config") -> CodecConfig:
        """Parse and validate the codec keys of a run/train/node config (``source`` names it in errors).

        Raises
        ------
        ValueError
            A key with a wrong type or out of range, or an unknown codec name.
        """
        out = cls(**{k.field: _RULE_READS.get(k.name, k.read)(cfg, source) for k in CODEC_KEYS.values()})
        if out.density_min > out.density_max:
            raise ValueError(f"{source} 'density-min' ({out.density_min}) must not exceed 'density-max' "
                             f"({out.density_max})")
        out.rules  # noqa: B018 - validates layer-codecs
        out._check_codec_options(source)
        return out

    def check_rules_match(self, keys: list[str]) -> None:
        """Every ``layer-codecs`` pattern must match at least one of the model's parameter names ``keys``.

        Raises
        ------
        ValueError
            Naming the rule that matches nothing, and the model's parameter names.
        """
        for pattern, name in self.rules:
            if not any(fnmatch.fnmatchcase(k, pattern) for k in keys):
                raise ValueError(f"run config 'layer-codecs': rule '{pattern}={name}' matches no parameter; "
                                 f"parameters are {keys}")

    def _check_codec_options(self, source: str) -> None:
        """Combinations of codec options that cannot work (each message names the key to change)."""
        used = {self.compressor, self.warmup_compressor} | {c for _, c in self.rules}
        values = self.to_mapping()
        for name in sorted(used, key=lambda c: CODECS[c].codec_id):
            try:
                CODECS[name].check_options(values)
            except ValueError as err:
                raise ValueError(f"{source} {err}") from None
        for name in sorted(used, key=lambda c: CODECS[c].codec_id):
            reason = CODECS[name].requires_error_feedback
            if reason and not self.error_feedback:
                raise ValueError(f"{source} 'error-feedback' must be true with compressor '{name}' ({reason})")
            if self.error_feedback:
                check_error_feedback(self.build(seed=0, compressor=name), f"{source} 'error-feedback'")
            if CODECS[name].per_tensor_only and self.selection == "model" and name in (self.compressor,
                                                                                       self.warmup_compressor):
                raise ValueError(f"{source} 'selection' must be 'tensor' or 'auto' with compressor '{name}' "
                                 "(a low-rank approximation is taken per parameter matrix)")
        if self.momentum_correction > 0 and self.error_feedback == "ef21":
            raise ValueError(f"{source} 'momentum-correction' must be 0 with error-feedback = 'ef21' (DGC's correction "
                             "works on a residual; EF21 keeps an estimate instead)")
        if self.momentum_correction > 0 and not self.error_feedback:
            raise ValueError(f"{source} 'momentum-correction' needs 'error-feedback' = true (the unsent part of "
                             "the momentum is kept in the residual)")
        if self.momentum_correction > 0 and not CODECS[self.compressor].sparse:
            raise ValueError(f"{source} 'momentum-correction' works with the sparsifying codecs {list(SPARSE_CODECS)} "
                             f"(DGC keeps the momentum of the entries not sent); compressor '{self.compressor}' sends "
                             "every entry each round, so the momentum would be masked away and do nothing: set "
                             "'momentum-correction' = 0 or choose a sparsifying compressor")

    @classmethod
    def from_kwargs(cls, compressor: str, error_feedback: bool, **params) -> CodecConfig:
        """Build from Python keyword arguments (``density=...``, ``block_size=...``), as the strategy
        wrappers take them.

        Raises
        ------
        TypeError
            A parameter that is not a codec key.
        ValueError
            A value out of range (see `from_mapping`).
        """
        mapping = {k.replace("_", "-"): v for k, v in params.items()}
        mapping.update({"compressor": compressor, "error-feedback": error_feedback})
        check_codec_kwargs(mapping)
        return cls.from_mapping(mapping)

    def to_mapping(self) -> dict[str, Any]:
        """The same keys as `from_mapping` reads (for a Flower ConfigRecord)."""
        return {k: getattr(self, k.replace("-", "_")) for k in CODEC_DEFAULTS}

    def build(self, seed: int | None = None, compressor: str | None = None, density: float | None = None) -> Compressor:
        """Instantiate the codec (or ``compressor``, e.g. a per-layer one) with the options it
        declares (``Compressor.options``; ``seed`` for stochastic codecs; ``density``, when
        given, instead of this config's)."""
        cls = CODECS[compressor or self.compressor]
        params: dict[str, Any] = {opt.arg: getattr(self, opt.field) for opt in cls.options}
        if density is not None and "density" in params:
            params["density"] = density
        if cls.seeded:
            params["seed"] = seed
        return cls(**params)

    def for_round(self, server_round: int) -> CodecConfig:
        """The codec in force in ``server_round`` (1-based): warm-up codec, then the scheduled density."""
        if server_round <= self.warmup_rounds:
            return replace(self, compressor=self.warmup_compressor, density_schedule="constant")
        return replace(self, density=self.scheduled_density(server_round))

    def scheduled_density(self, server_round: int) -> float:
        """Density of a "constant", "exponential" or "linear" schedule in ``server_round``.

        Round t after warm-up (t = 0, 1, ...): exponential ``start * (end/start)**(t/(R-1))``,
        linear ``start + (end - start) * t/(R-1)``, R = ``schedule-rounds``, then ``end`` =
        ``density``. With R = 1 the schedule is just ``density``.
        """
        if self.density_schedule in ("constant", "adaptive"):
            return self.density
        t = server_round - self.warmup_rounds - 1
        r = self.schedule_rounds
        if r <= 1 or t >= r - 1:
            return self.density
        frac = t / (r - 1)
        if self.density_schedule == "exponential":
            return float(self.density_start * (self.density / self.density_start) ** frac)
        return float(self.density_start + (self.density - self.density_start) * frac)

    def describe(self) -> str:
        """Short label such as ``stc(density=0.01)+EF [model]``."""
        c = self.build(seed=0).config()
        inner = ", ".join(f"{k}={v}" for k, v in c.items())
        extra = []
        if self.warmup_rounds:
            extra.append(f"warm-up {self.warmup_rounds} x {self.warmup_compressor}")
        if self.density_schedule != "constant":
            extra.append(f"density {self.density_schedule}")
        if self.layer_codecs:
            extra.append(f"layers {self.layer_codecs}")
        if self.min_compress_numel:
            extra.append(f"< {self.min_compress_numel} elements: {self.small_tensor_compressor}")
        if self.momentum_correction:
            extra.append(f"momentum correction {self.momentum_correction}")
        return (f"{self.compressor}({inner})" + ({"ef21": "+EF21", True: "+EF", False: ""}[self.error_feedback])
                + f" [{self.scope}]" + (f" ({'; '.join(extra)})" if extra else ""))


#: Every run-config / train-config key that describes the codec, in `CodecConfig`'s field order:
#: the policy keys (`POLICY_KEYS`) and the codec options (``Compressor.options``).
CODEC_KEYS: dict[str, Key] = table(*(POLICY_KEYS.get(name) or codec_options()[name]
                                     for name in (f.name.replace("_", "-") for f in fields(CodecConfig))))
#: The codec keys with their defaults (`CODEC_KEYS`'s, which are CodecConfig's field defaults).
CODEC_DEFAULTS: dict[str, Any] = defaults(CODEC_KEYS)


__all__ = ["CODEC_DEFAULTS", "CODEC_KEYS", "DENSITY_SCHEDULES", "POLICY_KEYS", "SPARSE_CODECS", "TENSOR_ONLY_CODECS",
           "CodecConfig", "parse_layer_codecs"]


def check_codec_kwargs(mapping: Mapping[str, Any]) -> None:
    """Refuse codec keyword arguments that are not codec keys (``mapping``'s keys in run-config form,
    ``block-size``), naming each with the closest valid one in Python form.

    Raises
    ------
    TypeError
        ``unknown codec parameter(s) ['denisty']: 'denisty': did you mean 'density'?``
    """
    unknown = sorted(set(mapping) - set(CODEC_DEFAULTS))
    if unknown:
        known = [k.replace("-", "_") for k in CODEC_DEFAULTS]
        hints = "; ".join(f"'{k.replace('-', '_')}': {closest_hint(k.replace('-', '_'), known, 'parameter')}"
                          for k in unknown)
        raise TypeError(f"unknown codec parameter(s) {[k.replace('-', '_') for k in unknown]}: {hints}")
