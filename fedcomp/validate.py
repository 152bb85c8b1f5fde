"""The one validator of numbers from configs and constructor arguments (run config, node config,
codec parameters, DP settings): a clear ``ValueError`` naming the setting and its allowed range."""

from __future__ import annotations

import math
import numbers


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
