"""Codec options: how a codec's constructor argument is named, typed, defaulted and checked in a
run config (``[tool.flwr.app.config]``), declared on the codec itself (``Compressor.options``).

Flower-free; ``fedcomp.config.CodecConfig`` builds its codec fields from these declarations.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from fedcomp.compression.wire import VALUE_DTYPES
from fedcomp.util.validate import read_bool, read_number, read_string


@dataclass(frozen=True)
class Option:
    """One codec option.

    Attributes
    ----------
    arg : str
        The codec constructor's keyword argument (``"density"``).
    key : str
        The run-config key it is read from (``"density"``, ``"block-size"``); several codecs may
        share a key when they declare it identically (stc, topk and randomk share ``density``).
    type : type
        ``int``, ``float``, ``str`` or ``bool``: the run-config value's type.
    default : Any
        The key's default (what ``pyproject.toml`` holds).
    lo, hi : float or None
        Numeric range (``None``: unbounded on that side); ``lo_open`` / ``hi_open`` exclude the bound.
    choices : collection of str, or callable returning one, or None
        Allowed strings (a callable is asked when the value is read, so that it may name codecs
        registered later).
    help : str
        One line for the documentation.
    """

    arg: str
    key: str
    type: type
    default: Any
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    choices: Collection[str] | Callable[[], Collection[str]] | None = None
    help: str = ""

    @property
    def field(self) -> str:
        """The key as a Python identifier (``block-size`` -> ``block_size``)."""
        return self.key.replace("-", "_")

    def allowed(self) -> Collection[str] | None:
        """The allowed strings (``choices``, called if callable), None when any string goes."""
        return self.choices() if callable(self.choices) else self.choices

    def read(self, cfg: Mapping[str, Any], source: str = "run config") -> Any:
        """``cfg[self.key]`` (the default when absent), checked.

        Raises
        ------
        ValueError
            ``"<source> '<key>' must be in (0, 1], got 1.5"``, a wrong type, or a string outside ``choices``.
        """
        if self.type is bool:
            return read_bool(cfg, self.key, self.default, src=source)
        if self.type is str:
            return read_string(cfg, self.key, self.default, self.allowed(), src=source)
        return read_number(cfg, self.key, self.default, lo=self.lo, hi=self.hi, lo_open=self.lo_open,
                           hi_open=self.hi_open, integer=self.type is int, src=source)


def merge_options(declared: Mapping[str, tuple[Option, ...]]) -> dict[str, Option]:
    """Every codec's options by run-config key, in the order first declared.

    Parameters
    ----------
    declared : mapping of codec name -> its options

    Raises
    ------
    ValueError
        Two codecs declare one key with another type, default, range or choices.
    """
    out: dict[str, Option] = {}
    owner: dict[str, str] = {}
    for name, options in declared.items():
        for opt in options:
            seen = out.get(opt.key)
            if seen is None:
                out[opt.key], owner[opt.key] = opt, name
            elif (seen.type, seen.default, seen.lo, seen.hi, seen.lo_open, seen.hi_open, seen.choices) != (
                    opt.type, opt.default, opt.lo, opt.hi, opt.lo_open, opt.hi_open, opt.choices):
                raise ValueError(f"codecs {owner[opt.key]!r} and {name!r} declare run-config key {opt.key!r} differently")
    return out


def _small_tensor_codecs() -> tuple[str, ...]:
    from fedcomp.compression.registry import codecs_with  # registry imports the codecs, which import this module

    return codecs_with(small_tensor=True)


#: Options several codecs share (declared once, so that their declarations agree).
DENSITY = Option("density", "density", float, 0.01, lo=0.0, hi=1.0, lo_open=True,
                 help="fraction of entries kept, in (0, 1]")
VALUE_DTYPE = Option("value_dtype", "value-dtype", str, "fp32", choices=tuple(VALUE_DTYPES),
                     help="wire type of the values: fp32 (exact) or fp16")
SMALL_TENSOR = Option("fallback", "small-tensor-compressor", str, "none", choices=_small_tensor_codecs,
                      help="codec of the tensors a low-rank codec does not pay on, and of the small tensors")
