"""Codec options: how a codec's constructor argument is named, typed, defaulted and checked in a
run config (``[tool.flwr.app.config]``), declared on the codec itself (``Compressor.options``).

Flower-free; ``fedcomp.config.CodecConfig`` builds its codec fields from these declarations.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fedcomp.compression.wire import VALUE_DTYPES
from fedcomp.util.declared_key import Key


@dataclass(frozen=True)
class Option(Key):
    """One codec option: a run-config `Key` (name, type, default,
    help, range or choices) and the codec constructor's keyword argument it fills (``arg``).

    Several codecs may share a key when they declare it identically (stc, topk and randomk share
    ``density``: `DENSITY`).
    """

    arg: str = ""

    @property
    def key(self) -> str:
        """The run-config key (``"block-size"``), i.e. `name`."""
        return self.name


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
                raise ValueError(f"codecs {owner[opt.key]!r} and {name!r} declare run-config key {opt.key!r} "
                                 "differently")
    return out


#: Options several codecs share (declared once, so that their declarations agree).
DENSITY = Option("density", float, 0.01, "fraction of entries kept, in (0, 1]", lo=0.0, hi=1.0, lo_open=True,
                 arg="density")
VALUE_DTYPE = Option("value-dtype", str, "fp32", "wire type of the values: fp32 (exact) or fp16",
                     choices=tuple(VALUE_DTYPES), arg="value_dtype")
