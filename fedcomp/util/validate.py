"""The one validator of numbers from configs and constructor arguments (run config, node config,
codec parameters, DP settings), and the typed readers of config keys built on it: a clear
``ValueError`` naming the setting and its allowed range."""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Mapping
from typing import Any


def closest_hint(name: str, known, what: str = "key") -> str:
    """How an error about the unknown ``name`` goes on: ``"did you mean 'density'?"`` for the closest
    of ``known`` by ``difflib`` similarity >= 0.6, compared case-insensitively (``DENSITY``, ``Density``
    -> ``density``), else ``"no similar <what>"``. The one source of the suggestion for a misspelt
    run-config key (`fedcomp.config.unknown_key_message`) and a misspelt codec parameter
    ([`fedcomp.compression.get_compressor`][])."""
    by_lower: dict[str, str] = {}
    for k in sorted(known):
        by_lower.setdefault(k.lower(), k)
    close = difflib.get_close_matches(str(name).lower(), sorted(by_lower), n=1, cutoff=0.6)
    return f"did you mean '{by_lower[close[0]]}'?" if close else f"no similar {what}"


def check_number(value, what: str, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
                 hi_open: bool = False, integer: bool = False, exact_type: bool = False) -> int | float:
    """``value`` as a finite ``int`` (``integer``) or ``float`` inside the interval.

    Parameters
    ----------
    value
        Anything; bools are not numbers here.
    what : str
        How the error names the setting, e.g. ``"run config 'density'"`` or ``"density"``.
    lo, hi : float, optional
        Bounds (None: unbounded on that side).
    lo_open, hi_open : bool
        Exclude the bound itself.
    integer : bool
        Require a whole number (a float such as 3.0 counts unless ``exact_type``).
    exact_type : bool
        With ``integer``: require an ``int`` (or numpy integer) object, not a whole float.

    Returns
    -------
    int or float

    Raises
    ------
    ValueError
        ``"<what> must be a number / an integer / a finite number / in [lo, hi], got <value>"``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{what} must be a number, got {value!r}")
    if integer:
        if (exact_type and not isinstance(value, numbers.Integral)) or not float(value).is_integer():
            raise ValueError(f"{what} must be an integer, got {value!r}")
        value = int(value)
    else:
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"{what} must be a finite number, got {value!r}")
    bad_lo = lo is not None and (value <= lo if lo_open else value < lo)
    bad_hi = hi is not None and (value >= hi if hi_open else value > hi)
    if bad_lo or bad_hi:
        left, right = "(" if lo_open else "[", ")" if hi_open else "]"
        raise ValueError(f"{what} must be in {left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}"
                         f"{right}, got {value!r}")
    return value


def read_number(cfg: Mapping[str, Any], key: str, default, *, lo=None, hi=None, lo_open=False, hi_open=False,
                integer=False, src: str = "run config") -> int | float:
    """``cfg[key]`` (``default`` when absent) checked by `check_number`, named ``<src> '<key>'``.

    Raises
    ------
    ValueError
        See `check_number`.
    """
    return check_number(cfg.get(key, default), f"{src} '{key}'", lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open,
                        integer=integer)


def read_string(cfg: Mapping[str, Any], key: str, default: str, choices=None, src: str = "run config") -> str:
    """``cfg[key]`` (``default`` when absent) as a string, one of ``choices`` when given.

    Raises
    ------
    ValueError
        ``"<src> '<key>' must be a string"`` or ``"... must be one of [...]"``.
    """
    value = cfg.get(key, default)
    if not isinstance(value, str):
        raise ValueError(f"{src} '{key}' must be a string, got {value!r}")
    if choices is not None and value not in choices:
        raise ValueError(f"{src} '{key}' must be one of {sorted(choices)}, got {value!r}")
    return value


def read_bool(cfg: Mapping[str, Any], key: str, default: bool, src: str = "run config") -> bool:
    """``cfg[key]`` (``default`` when absent) as a bool: ``"true"`` or 1 are refused, not read as true.

    Raises
    ------
    ValueError
        ``"<src> '<key>' must be true or false"``.
    """
    value = cfg.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{src} '{key}' must be true or false, got {value!r}")
    return value
