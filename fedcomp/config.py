"""Run-config parsing and validation (Flower-free).

Every key of ``[tool.flwr.app.config]`` is read here, checked for type and range, and
turned into plain dataclasses. Errors name the key and its allowed range, e.g.
``ValueError: run config 'density' must be in (0, 1], got 1.5``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from .compression import Compressor, available_compressors, get_compressor

#: run-config / train-config keys that describe the codec, with their defaults.
CODEC_DEFAULTS: dict[str, Any] = {
    "compressor": "stc",
    "density": 0.01,
    "levels": 15,
    "block-size": 256,
    "value-dtype": "fp32",
    "error-feedback": True,
    "residual-dtype": "fp32",
    "selection": "auto",
}

#: Codecs that choose entries (their k is taken over the whole model with selection "auto").
SPARSE_CODECS = ("stc", "topk", "randomk")


def _num(cfg: Mapping[str, Any], key: str, default, *, lo=None, hi=None, lo_open=False, hi_open=False,
         integer=False):
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"run config '{key}' must be a number, got {value!r}")
    if integer:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"run config '{key}' must be an integer, got {value!r}")
        value = int(value)
    else:
        value = float(value)
    if value != value:
        raise ValueError(f"run config '{key}' must be a number, got NaN")
    bad_lo = lo is not None and (value <= lo if lo_open else value < lo)
    bad_hi = hi is not None and (value >= hi if hi_open else value > hi)
    if bad_lo or bad_hi:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        raise ValueError(
            f"run config '{key}' must be in {left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}, "
            f"got {value!r}"
        )
    return value


def _str(cfg: Mapping[str, Any], key: str, default: str, choices=None) -> str:
    value = cfg.get(key, default)
    if not isinstance(value, str):
        raise ValueError(f"run config '{key}' must be a string, got {value!r}")
    if choices is not None and value not in choices:
        raise ValueError(f"run config '{key}' must be one of {sorted(choices)}, got {value!r}")
    return value


def _bool(cfg: Mapping[str, Any], key: str, default: bool) -> bool:
    value = cfg.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"run config '{key}' must be true or false, got {value!r}")
    return value


@dataclass(frozen=True)
class CodecConfig:
    """Which codec a client uses and how (keys: ``compressor``, ``density``, ``levels``,
    ``block-size``, ``value-dtype``, ``error-feedback``, ``residual-dtype``, ``selection``).

    ``selection`` is the scope a codec works on: "tensor" (one payload per parameter
    tensor) or "model" (the whole flattened update as one payload, so top-k/STC pick their
    k entries over the whole model). "auto" (default) is "model" for stc/topk/randomk and
    "tensor" for the rest: a study on the default data found whole-model selection more
    accurate and cheaper for top-k/STC, and one scale per tensor better for sign.
    """

    compressor: str = "stc"
    density: float = 0.01
    levels: int = 15
    block_size: int = 256
    value_dtype: str = "fp32"
    error_feedback: bool = True
    residual_dtype: str = "fp32"
    selection: str = "auto"

    @property
    def scope(self) -> str:
        """The resolved selection scope, "tensor" or "model"."""
        if self.selection != "auto":
            return self.selection
        return "model" if self.compressor in SPARSE_CODECS else "tensor"

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> "CodecConfig":
        """Parse and validate the codec keys of a run/train/node config.

        Raises
        ------
        ValueError
            A key with a wrong type or out of range, or an unknown codec name.
        """
        d = CODEC_DEFAULTS
        return cls(
            compressor=_str(cfg, "compressor", d["compressor"], available_compressors()),
            density=_num(cfg, "density", d["density"], lo=0.0, hi=1.0, lo_open=True),
            levels=_num(cfg, "levels", d["levels"], lo=1, hi=2**16 - 1, integer=True),
            block_size=_num(cfg, "block-size", d["block-size"], lo=1, hi=2**31 - 1, integer=True),
            value_dtype=_str(cfg, "value-dtype", d["value-dtype"], ("fp32", "fp16")),
            error_feedback=_bool(cfg, "error-feedback", d["error-feedback"]),
            residual_dtype=_str(cfg, "residual-dtype", d["residual-dtype"], ("fp32", "fp16")),
            selection=_str(cfg, "selection", d["selection"], ("auto", "tensor", "model")),
        )

    def to_mapping(self) -> dict[str, Any]:
        """The same keys as :meth:`from_mapping` reads (for a Flower ConfigRecord)."""
        return {
            "compressor": self.compressor, "density": self.density, "levels": self.levels,
            "block-size": self.block_size, "value-dtype": self.value_dtype,
            "error-feedback": self.error_feedback, "residual-dtype": self.residual_dtype,
            "selection": self.selection,
        }

    def build(self, seed: int | None = None) -> Compressor:
        """Instantiate the codec with the parameters it takes."""
        params: dict[str, Any] = {}
        if self.compressor in ("stc", "topk", "randomk"):
            params["density"] = self.density
        if self.compressor == "topk":
            params["value_dtype"] = self.value_dtype
        if self.compressor == "qsgd":
            params["levels"] = self.levels
        if self.compressor == "int8":
            params["block_size"] = self.block_size
        if self.compressor in ("qsgd", "int8", "randomk"):
            params["seed"] = seed
        return get_compressor(self.compressor, **params)

    def describe(self) -> str:
        """Short label such as ``stc(density=0.01)+EF``."""
        c = self.build(seed=0).config()
        inner = ", ".join(f"{k}={v}" for k, v in c.items())
        return f"{self.compressor}({inner})" + ("+EF" if self.error_feedback else "") + f" [{self.scope}]"


@dataclass(frozen=True)
class AppConfig:
    """Everything the ServerApp and ClientApp read from the run config."""

    num_server_rounds: int = 50
    fraction_train: float = 1.0
    min_train_nodes: int = 2
    min_available_nodes: int = 2
    strategy: str = "fedavg"
    server_lr: float = 0.1
    lr: float = 0.1
    momentum: float = 0.9
    local_epochs: int = 1
    batch_size: int = 32
    accumulation_steps: int = 1
    seed: int = 42
    dataset: str = "digits"
    model: str = "cnn"
    partitioner: str = "dirichlet"
    dirichlet_alpha: float = 0.5
    results_dir: str = ""
    round_timeout: float = 600.0
    codec: CodecConfig = field(default_factory=CodecConfig)

    @classmethod
    def from_run_config(cls, cfg: Mapping[str, Any]) -> "AppConfig":
        """Parse and validate a Flower run config (``context.run_config``).

        Raises
        ------
        ValueError
            Naming the first bad key and its allowed range.
        """
        return cls(
            num_server_rounds=_num(cfg, "num-server-rounds", 50, lo=1, integer=True),
            fraction_train=_num(cfg, "fraction-train", 1.0, lo=0.0, hi=1.0, lo_open=True),
            min_train_nodes=_num(cfg, "min-train-nodes", 2, lo=1, integer=True),
            min_available_nodes=_num(cfg, "min-available-nodes", 2, lo=1, integer=True),
            strategy=_str(cfg, "strategy", "fedavg", ("fedavg", "fedadam")),
            server_lr=_num(cfg, "server-lr", 0.1, lo=0.0, lo_open=True),
            lr=_num(cfg, "lr", 0.1, lo=0.0, lo_open=True),
            momentum=_num(cfg, "momentum", 0.9, lo=0.0, hi=1.0, hi_open=True),
            local_epochs=_num(cfg, "local-epochs", 1, lo=1, integer=True),
            batch_size=_num(cfg, "batch-size", 32, lo=1, integer=True),
            accumulation_steps=_num(cfg, "accumulation-steps", 1, lo=1, integer=True),
            seed=_num(cfg, "seed", 42, lo=0, hi=2**31 - 1, integer=True),
            dataset=_str(cfg, "dataset", "digits"),
            model=_str(cfg, "model", "cnn", ("cnn", "mlp")),
            partitioner=_str(cfg, "partitioner", "dirichlet", ("iid", "dirichlet")),
            dirichlet_alpha=_num(cfg, "dirichlet-alpha", 0.5, lo=0.0, lo_open=True),
            results_dir=_str(cfg, "results-dir", ""),
            round_timeout=_num(cfg, "round-timeout", 600.0, lo=0.0, lo_open=True),
            codec=CodecConfig.from_mapping(cfg),
        )
