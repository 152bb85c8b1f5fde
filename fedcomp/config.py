"""Run-config parsing and validation (Flower-free).

Every key of ``[tool.flwr.app.config]`` is read here, checked for type and range, and
turned into plain dataclasses. Errors name the key and its allowed range, e.g.
``ValueError: run config 'density' must be in (0, 1], got 1.5``.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping

from .compression import CODECS, Compressor, available_compressors
from .compression.qsgd import MAX_EXPONENTIAL_LEVELS, SPACINGS
from .low_density import resolve_schedule, resolve_strategy
from .protocol import DEFAULT_DOWNLINK_MBPS, DEFAULT_UPLINK_MBPS, MIN_LINK_MBPS
from .training import TrainConfig
from .validate import check_number

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
    ``secagg*`` keys of :data:`fedcomp.secagg.config.SECAGG_DEFAULTS` and the LoRA keys of
    :data:`fedcomp.lora.LORA_DEFAULTS`."""
    from .lora import LORA_DEFAULTS
    from .secagg.config import SECAGG_DEFAULTS  # here: fedcomp.secagg imports Flower

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
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'?" if close else "no similar key"
    return (f"{source} key '{key}' is unknown; {hint} (every key, with its default, is in [tool.flwr.app.config] "
            "of pyproject.toml)")


#: Codecs that choose entries (their k is taken over the whole model with selection "auto").
SPARSE_CODECS = ("stc", "topk", "randomk")
#: ``dp`` modes: none; sample-level DP-SGD on clients (Opacus); client-level DP-FedAvg on the
#: server; local clip + noise of each update on the client before compression.
DP_MODES = ("none", "dp-sgd", "client-level", "local")
DENSITY_SCHEDULES = ("auto", "constant", "exponential", "linear", "adaptive")
#: Codecs that work per tensor only ("selection" must resolve to "tensor").
TENSOR_ONLY_CODECS = ("powersgd",)


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


def _num(cfg: Mapping[str, Any], key: str, default, *, lo=None, hi=None, lo_open=False, hi_open=False,
         integer=False, src: str = "run config"):
    return check_number(cfg.get(key, default), f"{src} '{key}'", lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open,
                        integer=integer)


def _str(cfg: Mapping[str, Any], key: str, default: str, choices=None, src: str = "run config") -> str:
    value = cfg.get(key, default)
    if not isinstance(value, str):
        raise ValueError(f"{src} '{key}' must be a string, got {value!r}")
    if choices is not None and value not in choices:
        raise ValueError(f"{src} '{key}' must be one of {sorted(choices)}, got {value!r}")
    return value


def _bool(cfg: Mapping[str, Any], key: str, default: bool, src: str = "run config") -> bool:
    value = cfg.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{src} '{key}' must be true or false, got {value!r}")
    return value


def _error_feedback(cfg: Mapping[str, Any], default, source: str) -> bool | str:
    """``error-feedback``: true (classic residual), false, or "ef21" (Richtárik et al. 2021)."""
    value = cfg.get("error-feedback", default)
    if value == "ef21" or isinstance(value, bool):
        return value
    raise ValueError(f"{source} 'error-feedback' must be true, false or \"ef21\", got {value!r}")


@dataclass(frozen=True)
class CodecConfig:
    """Which codec a client uses and how: the keys of :data:`CODEC_DEFAULTS` (the fields below, with
    ``-`` for ``_``; each field's default is the key's default).

    ``selection`` is the scope a codec works on: "tensor" (one payload per parameter
    tensor) or "model" (the whole flattened update as one payload, so top-k/STC pick their
    k entries over the whole model). "auto" (default) is "model" for stc/topk/randomk and
    "tensor" for the rest: a study on the default data found whole-model selection more
    accurate and cheaper for top-k/STC, and one scale per tensor better for sign.

    ``error-feedback``: true (classic error feedback: send ``C(update + residual)``, keep the
    residual), false, or "ef21" (Richtárik et al. 2021: send ``C(update - h)``; client and server
    both add the decoded send to their estimate h and the server applies its h; needs a
    weighted-mean inner strategy and no client-level DP).

    Per-layer policy: ``layer-codecs`` rules (first match wins) give some parameters their
    own codec; parameters with fewer than ``min-compress-numel`` elements use
    ``small-tensor-compressor`` ("none" or "fp16"); the rest use ``compressor``. BatchNorm's
    statistics (tensors named ``*.running_mean`` / ``*.running_var``) use
    ``small-tensor-compressor`` too while ``batchnorm-stats = "small"`` (the default): a lossy
    codec can push a running variance below zero, which turns every later output into NaN
    (measured: sign + EF on ``model = "resnet"`` reached 75 % at round 3, then 10 % at round 4 with
    ``bn1.running_var`` at -0.013); ``"codec"`` sends them like any other tensor. BatchNorm's
    affine parameters (``<bn>.weight`` / ``<bn>.bias``) go there too with stc/topk/randomk when
    ``batchnorm-affine = "small"`` (default "codec": measured on ``model = "resnet"``, sending them
    dense did not pay for its bytes; see :mod:`fedcomp.model_policy`).
    Schedules (applied by the server each round): ``warmup-rounds`` rounds with
    ``warmup-compressor``, then ``density-schedule`` "auto" (the default: "exponential" for
    stc/topk with error feedback below density 1/400, else "constant"; :mod:`fedcomp.low_density`),
    "constant", "exponential" or "linear"
    from ``density-start`` to ``density`` over ``schedule-rounds`` rounds (DGC's warm-up,
    Lin et al. ICLR 2018), or "adaptive": each client picks the smallest density in
    [``density-min``, ``density-max``] whose relative compression error on its current
    update is at most ``target-error``.

    Codec options: ``rank`` (powersgd, r >= 1), ``unbiased`` (eden: DRIVE's unbiased scale
    instead of the least-squares one), ``spacing`` (qsgd: "uniform" or NUQSGD's "exponential",
    which takes at most 126 levels), ``momentum-correction`` (DGC's beta in [0, 1), 0 = off:
    the client accumulates u <- beta u + update and sends the sparsified residual of u; it
    needs ``error-feedback``). PowerSGD is per tensor ("auto" selection gives "tensor", "model"
    is refused) and needs error feedback (it is biased; its warm-start Q is kept with the
    residual); tensors where low rank does not pay go through ``small-tensor-compressor``.
    """

    compressor: str = "stc"
    density: float = 0.01
    levels: int = 15
    block_size: int = 256
    value_dtype: str = "fp32"
    error_feedback: bool | str = True
    residual_dtype: str = "fp32"
    selection: str = "auto"
    min_compress_numel: int = 0
    small_tensor_compressor: str = "none"
    batchnorm_stats: str = "small"
    batchnorm_affine: str = "codec"
    layer_codecs: str = ""
    warmup_rounds: int = 0
    warmup_compressor: str = "none"
    density_schedule: str = "auto"
    density_start: float = 0.25
    schedule_rounds: int = 30
    target_error: float = 0.5
    density_min: float = 0.001
    density_max: float = 0.25
    rank: int = 4
    unbiased: bool = False
    spacing: str = "uniform"
    momentum_correction: float = 0.0

    def __post_init__(self) -> None:
        # "auto": DGC's warm-up for stc/topk below 1/400, else constant (fedcomp.low_density)
        object.__setattr__(self, "density_schedule", resolve_schedule(
            self.density_schedule, self.compressor, self.density, self.error_feedback, self.warmup_rounds))

    @property
    def scope(self) -> str:
        """The resolved selection scope, "tensor" or "model"."""
        if self.selection != "auto":
            return self.selection
        return "model" if self.compressor in SPARSE_CODECS else "tensor"

    @property
    def rules(self) -> list[tuple[str, str]]:
        """Parsed ``layer-codecs`` rules."""
        return parse_layer_codecs(self.layer_codecs)

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any], source: str = "run config") -> "CodecConfig":
        """Parse and validate the codec keys of a run/train/node config (``source`` names it in errors).

        Raises
        ------
        ValueError
            A key with a wrong type or out of range, or an unknown codec name.
        """
        d = CODEC_DEFAULTS
        codecs = available_compressors()
        out = cls(
            compressor=_str(cfg, "compressor", d["compressor"], codecs, src=source),
            density=_num(cfg, "density", d["density"], lo=0.0, hi=1.0, lo_open=True, src=source),
            levels=_num(cfg, "levels", d["levels"], lo=1, hi=2**16 - 1, integer=True, src=source),
            block_size=_num(cfg, "block-size", d["block-size"], lo=1, hi=2**31 - 1, integer=True, src=source),
            value_dtype=_str(cfg, "value-dtype", d["value-dtype"], ("fp32", "fp16"), src=source),
            error_feedback=_error_feedback(cfg, d["error-feedback"], source),
            residual_dtype=_str(cfg, "residual-dtype", d["residual-dtype"], ("fp32", "fp16"), src=source),
            selection=_str(cfg, "selection", d["selection"], ("auto", "tensor", "model"), src=source),
            min_compress_numel=_num(cfg, "min-compress-numel", d["min-compress-numel"], lo=0, integer=True, src=source),
            small_tensor_compressor=_str(cfg, "small-tensor-compressor", d["small-tensor-compressor"],
                                         ("none", "fp16", "bf16"), src=source),
            batchnorm_stats=_str(cfg, "batchnorm-stats", d["batchnorm-stats"], ("small", "codec"), src=source),
            batchnorm_affine=_str(cfg, "batchnorm-affine", d["batchnorm-affine"], ("small", "codec"), src=source),
            layer_codecs=_str(cfg, "layer-codecs", d["layer-codecs"], src=source),
            warmup_rounds=_num(cfg, "warmup-rounds", d["warmup-rounds"], lo=0, integer=True, src=source),
            warmup_compressor=_str(cfg, "warmup-compressor", d["warmup-compressor"], codecs, src=source),
            density_schedule=_str(cfg, "density-schedule", d["density-schedule"], DENSITY_SCHEDULES, src=source),
            density_start=_num(cfg, "density-start", d["density-start"], lo=0.0, hi=1.0, lo_open=True, src=source),
            schedule_rounds=_num(cfg, "schedule-rounds", d["schedule-rounds"], lo=1, integer=True, src=source),
            target_error=_num(cfg, "target-error", d["target-error"], lo=0.0, hi=1.0, lo_open=True, src=source),
            density_min=_num(cfg, "density-min", d["density-min"], lo=0.0, hi=1.0, lo_open=True, src=source),
            density_max=_num(cfg, "density-max", d["density-max"], lo=0.0, hi=1.0, lo_open=True, src=source),
            rank=_num(cfg, "rank", d["rank"], lo=1, hi=2**16 - 1, integer=True, src=source),
            unbiased=_bool(cfg, "unbiased", d["unbiased"], src=source),
            spacing=_str(cfg, "spacing", d["spacing"], SPACINGS, src=source),
            momentum_correction=_num(cfg, "momentum-correction", d["momentum-correction"], lo=0.0, hi=1.0,
                                     hi_open=True, src=source),
        )
        if out.density_min > out.density_max:
            raise ValueError(f"{source} 'density-min' ({out.density_min}) must not exceed 'density-max' "
                             f"({out.density_max})")
        out.rules  # noqa: B018 - validates layer-codecs
        out._check_codec_options(source)
        return out

    def _check_codec_options(self, source: str) -> None:
        """Combinations of codec options that cannot work (each message names the key to change)."""
        used = {self.compressor, self.warmup_compressor} | {c for _, c in self.rules}
        if self.spacing == "exponential" and "qsgd" in used and self.levels > MAX_EXPONENTIAL_LEVELS:
            raise ValueError(f"{source} 'levels' must be in [1, {MAX_EXPONENTIAL_LEVELS}] with spacing = "
                             f"'exponential', got {self.levels}")
        for name in TENSOR_ONLY_CODECS:
            if name in used and not self.error_feedback:
                raise ValueError(f"{source} 'error-feedback' must be true with compressor '{name}' (PowerSGD is "
                                 "biased and keeps its warm-start Q with the residual; Vogels et al. 2019)")
            if self.selection == "model" and name in (self.compressor, self.warmup_compressor):
                raise ValueError(f"{source} 'selection' must be 'tensor' or 'auto' with compressor '{name}' "
                                 "(a low-rank approximation is taken per parameter matrix)")
        if self.momentum_correction > 0 and self.error_feedback == "ef21":
            raise ValueError(f"{source} 'momentum-correction' must be 0 with error-feedback = 'ef21' (DGC's correction "
                             "works on a residual; EF21 keeps an estimate instead)")
        if self.momentum_correction > 0 and not self.error_feedback:
            raise ValueError(f"{source} 'momentum-correction' needs 'error-feedback' = true (the unsent part of "
                             "the momentum is kept in the residual)")
        if self.momentum_correction > 0 and self.compressor not in SPARSE_CODECS:
            raise ValueError(f"{source} 'momentum-correction' works with the sparsifying codecs {list(SPARSE_CODECS)} "
                             f"(DGC keeps the momentum of the entries not sent); compressor '{self.compressor}' sends "
                             "every entry each round, so the momentum would be masked away and do nothing: set "
                             "'momentum-correction' = 0 or choose a sparsifying compressor")

    @classmethod
    def from_kwargs(cls, compressor: str, error_feedback: bool, **params) -> "CodecConfig":
        """Build from Python keyword arguments (``density=...``, ``block_size=...``), as the strategy
        wrappers take them.

        Raises
        ------
        TypeError
            A parameter that is not a codec key.
        ValueError
            A value out of range (see :meth:`from_mapping`).
        """
        mapping = {k.replace("_", "-"): v for k, v in params.items()}
        mapping.update({"compressor": compressor, "error-feedback": error_feedback})
        unknown = set(mapping) - set(CODEC_DEFAULTS)
        if unknown:
            raise TypeError(f"unknown codec parameter(s) {sorted(unknown)}")
        return cls.from_mapping(mapping)

    def to_mapping(self) -> dict[str, Any]:
        """The same keys as :meth:`from_mapping` reads (for a Flower ConfigRecord)."""
        return {k: getattr(self, k.replace("-", "_")) for k in CODEC_DEFAULTS}

    def build(self, seed: int | None = None, compressor: str | None = None, density: float | None = None) -> Compressor:
        """Instantiate the codec (or ``compressor``, e.g. a per-layer one) with the parameters it
        declares (``Compressor.config_keys``; ``seed`` for stochastic codecs; ``density``, when
        given, instead of this config's)."""
        cls = CODECS[compressor or self.compressor]
        params: dict[str, Any] = {arg: getattr(self, key.replace("-", "_")) for arg, key in cls.config_keys.items()}
        if density is not None and "density" in params:
            params["density"] = density
        if cls.seeded:
            params["seed"] = seed
        return cls(**params)

    def for_round(self, server_round: int) -> "CodecConfig":
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
        return (f"{self.compressor}({inner})" + ({"ef21": "+EF21", True: "+EF", False: ""}[self.error_feedback]) + f" [{self.scope}]"
                + (f" ({'; '.join(extra)})" if extra else ""))


#: run-config / train-config keys that describe the codec, with their defaults (CodecConfig's fields).
CODEC_DEFAULTS: dict[str, Any] = {f.name.replace("_", "-"): f.default for f in fields(CodecConfig)}


@dataclass(frozen=True)
class AppConfig:
    """Everything the ServerApp and ClientApp read from the run config.

    ``strategy`` "auto" (the default) is resolved when parsing: "fedavgm" with server learning rate
    1.0 and momentum 0.5 for stc/topk below density 1/400 with classic error feedback, no momentum
    correction and no DP, else "fedavg" (:mod:`fedcomp.low_density`, measured in issue 25).
    """

    num_server_rounds: int = 50
    fraction_train: float = 1.0
    fraction_evaluate: float = 0.5
    min_train_nodes: int = 2
    min_available_nodes: int = 2
    strategy: str = "auto"
    server_lr: float = 0.1
    server_momentum: float = 0.9
    lr: float = TrainConfig.lr
    momentum: float = TrainConfig.momentum
    local_epochs: int = TrainConfig.local_epochs
    batch_size: int = TrainConfig.batch_size
    accumulation_steps: int = TrainConfig.accumulation_steps
    seed: int = 42
    dataset: str = "digits"
    model: str = "cnn"
    partitioner: str = "dirichlet"
    dirichlet_alpha: float = 0.5
    results_dir: str = ""
    round_timeout: float = 600.0
    resume: bool = False
    client_sampling: str = "fraction"
    uplink_mbps: float = DEFAULT_UPLINK_MBPS
    downlink_mbps: float = DEFAULT_DOWNLINK_MBPS
    client_state_dir: str = ""
    verbose: bool = False
    downstream: str = "none"
    dp: str = "none"
    clipping_norm: float = 1.0
    noise_multiplier: float = 1.0
    target_delta: float = 1e-5
    max_epsilon: float = 0.0
    require_compression: bool = False
    local_clip_norm: float = TrainConfig.local_clip_norm
    optimizer: str = "sgd"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    weight_decay: float = 0.0
    precision: str = "fp32"
    finetune: str = "full"
    codec: CodecConfig = field(default_factory=CodecConfig)

    @classmethod
    def from_run_config(cls, cfg: Mapping[str, Any]) -> "AppConfig":
        """Parse and validate a Flower run config (``context.run_config``).

        Raises
        ------
        ValueError
            Naming the first bad key and its allowed range, or an unknown key with the closest
            valid name (:func:`check_known_keys`).
        """
        check_known_keys(cfg)
        _bool(cfg, "secagg", False)  # "true" or 1 would otherwise run silently WITHOUT secure aggregation
        d = {f.name: f.default for f in fields(cls)}
        out = cls(
            num_server_rounds=_num(cfg, "num-server-rounds", d["num_server_rounds"], lo=1, integer=True),
            fraction_train=_num(cfg, "fraction-train", d["fraction_train"], lo=0.0, hi=1.0, lo_open=True),
            fraction_evaluate=_num(cfg, "fraction-evaluate", d["fraction_evaluate"], lo=0.0, hi=1.0),
            min_train_nodes=_num(cfg, "min-train-nodes", d["min_train_nodes"], lo=1, integer=True),
            min_available_nodes=_num(cfg, "min-available-nodes", d["min_available_nodes"], lo=1, integer=True),
            strategy=_str(cfg, "strategy", d["strategy"], ("auto", "fedavg", "fedadam", "fedavgm")),
            server_momentum=_num(cfg, "server-momentum", d["server_momentum"], lo=0.0, hi=1.0, hi_open=True),
            server_lr=_num(cfg, "server-lr", d["server_lr"], lo=0.0, lo_open=True),
            lr=_num(cfg, "lr", d["lr"], lo=0.0, lo_open=True),
            momentum=_num(cfg, "momentum", d["momentum"], lo=0.0, hi=1.0, hi_open=True),
            local_epochs=_num(cfg, "local-epochs", d["local_epochs"], lo=1, integer=True),
            batch_size=_num(cfg, "batch-size", d["batch_size"], lo=1, integer=True),
            accumulation_steps=_num(cfg, "accumulation-steps", d["accumulation_steps"], lo=1, integer=True),
            seed=_num(cfg, "seed", d["seed"], lo=0, hi=2**31 - 1, integer=True),
            dataset=_str(cfg, "dataset", d["dataset"]),
            model=_str(cfg, "model", d["model"], ("cnn", "mlp", "resnet", "transformer")),
            partitioner=_str(cfg, "partitioner", d["partitioner"], ("iid", "dirichlet")),
            dirichlet_alpha=_num(cfg, "dirichlet-alpha", d["dirichlet_alpha"], lo=0.0, lo_open=True),
            results_dir=_str(cfg, "results-dir", d["results_dir"]),
            round_timeout=_num(cfg, "round-timeout", d["round_timeout"], lo=0.0, lo_open=True),
            resume=_bool(cfg, "resume", d["resume"]),
            client_sampling=_str(cfg, "client-sampling", d["client_sampling"], ("fraction", "poisson")),
            uplink_mbps=_num(cfg, "uplink-mbps", d["uplink_mbps"], lo=MIN_LINK_MBPS),
            downlink_mbps=_num(cfg, "downlink-mbps", d["downlink_mbps"], lo=MIN_LINK_MBPS),
            client_state_dir=_str(cfg, "client-state-dir", d["client_state_dir"]),
            verbose=_bool(cfg, "verbose", d["verbose"]),
            downstream=_str(cfg, "downstream", d["downstream"], tuple(available_compressors())),
            dp=_str(cfg, "dp", d["dp"], DP_MODES),
            clipping_norm=_num(cfg, "clipping-norm", d["clipping_norm"], lo=0.0, lo_open=True),
            noise_multiplier=_num(cfg, "noise-multiplier", d["noise_multiplier"], lo=0.0),
            target_delta=_num(cfg, "target-delta", d["target_delta"], lo=0.0, hi=1.0, lo_open=True, hi_open=True),
            max_epsilon=_num(cfg, "max-epsilon", d["max_epsilon"], lo=0.0),
            require_compression=_bool(cfg, "require-compression", d["require_compression"]),
            local_clip_norm=_num(cfg, "local-clip-norm", d["local_clip_norm"], lo=0.0),
            optimizer=_str(cfg, "optimizer", d["optimizer"], ("sgd", "adamw")),
            adam_beta1=_num(cfg, "adam-beta1", d["adam_beta1"], lo=0.0, hi=1.0, hi_open=True),
            adam_beta2=_num(cfg, "adam-beta2", d["adam_beta2"], lo=0.0, hi=1.0, hi_open=True),
            weight_decay=_num(cfg, "weight-decay", d["weight_decay"], lo=0.0),
            precision=_str(cfg, "precision", d["precision"], ("fp32", "bf16")),
            finetune=_str(cfg, "finetune", d["finetune"], ("full", "lora")),
            codec=CodecConfig.from_mapping(cfg),
        )
        # "auto": FedAvgM for stc/topk below 1/400, else FedAvg (fedcomp.low_density)
        strategy, server_lr, server_momentum = resolve_strategy(out.strategy, out.server_lr, out.server_momentum,
                                                                out.codec, out.dp)
        out = replace(out, strategy=strategy, server_lr=server_lr, server_momentum=server_momentum)
        if out.codec.error_feedback == "ef21" and (out.fraction_train < 1.0 or out.client_sampling != "fraction"):
            raise ValueError("run config error-feedback = 'ef21' needs every client in every round: 'fraction-train' "
                             "= 1.0 and 'client-sampling' = 'fraction' (and 'min-train-nodes' = "
                             "'min-available-nodes' = all nodes); the server's single estimate h keeps a "
                             f"departed client's last h_i, got fraction-train = {out.fraction_train}, "
                             f"client-sampling = {out.client_sampling!r}")
        if out.downstream in TENSOR_ONLY_CODECS:
            raise ValueError(f"run config 'downstream' cannot be {out.downstream!r}: the server sends the model "
                             "change as one flat vector, which has no matrix to approximate")
        if out.local_clip_norm > 0 and out.dp == "dp-sgd":
            raise ValueError("run config 'local-clip-norm' must be 0 with dp = 'dp-sgd' (DP-SGD clips every "
                             "per-sample gradient to 'max-grad-norm' instead)")
        if out.dp == "dp-sgd" and (out.optimizer != "sgd" or out.precision != "fp32"):
            raise ValueError("run config dp = 'dp-sgd' trains with optimizer = 'sgd' and precision = 'fp32'")
        if (out.dataset == "shakespeare") != (out.model == "transformer"):
            raise ValueError("run config dataset = 'shakespeare' goes with model = 'transformer' (and only it), "
                             f"got dataset = {out.dataset!r}, model = {out.model!r}")
        if out.finetune == "lora":
            from .lora import LoraSettings

            LoraSettings.from_mapping(cfg)  # base-model, lora-r, lora-alpha, lora-targets, ... (naming the key)
            if out.dataset != "shakespeare":
                raise ValueError("run config finetune = 'lora' fine-tunes a causal LM on text: dataset = 'shakespeare'")
            if out.dp == "dp-sgd" or out.resume:
                raise ValueError("run config finetune = 'lora' works without dp = 'dp-sgd' and resume = true (not yet)")
        return out
