"""The exact rule of integer and bool tensors: their values cast without wrap-around, differences and
weighted sums in exact integer arithmetic, the weighted integer mean (rounded half to even, the
remainder carried from round to round, clamped to the dtype) and the weighted bool majority."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from fedcomp.statedict.arrays import copy_array


def exact_cast(key: str, value, dtype) -> np.ndarray:
    """An integer/bool tensor returned by the app, in the model's ``dtype``, never wrapped around.

    A wider dtype (int16 300 for an int8 buffer, int64 263 for uint8) is accepted only if every
    value fits the model's dtype; then the cast is exact.

    Parameters
    ----------
    key : str
        The tensor's name (for the message).
    value : array-like
        The app's integer or bool values.
    dtype : numpy dtype
        The model's (received) integer or bool dtype.

    Returns
    -------
    np.ndarray
        ``value`` in ``dtype``, same shape (the input itself when the dtype already matches).

    Raises
    ------
    ValueError
        A value outside ``dtype``'s range (for bool: other than 0 and 1), naming the key, both
        dtypes and the offending extreme.
    """
    v, want = np.asarray(value), np.dtype(dtype)
    if v.dtype == want:
        return v
    if v.size:
        lo, hi = (0, 1) if want == np.bool_ else (int(np.iinfo(want).min), int(np.iinfo(want).max))
        vmin, vmax = int(v.min()), int(v.max())
        if vmin < lo or vmax > hi:
            bad = vmax if vmax > hi else vmin
            raise ValueError(f"'{key}': the app returned {v.dtype} values such as {bad} for a {want} tensor (range "
                             f"[{lo}, {hi}]); refusing to wrap them around: keep the tensor's dtype in the train "
                             "handler or clamp the values yourself")
    return v.astype(want)


def exact_weight(weight) -> int | Fraction:
    """A client weight as an exact number: a Python int when it is integral (``num-examples``),
    else the exact Fraction of the float. Raises ``ValueError`` for a non-finite or negative weight."""
    w = float(weight) if not isinstance(weight, (int, Fraction)) else weight
    if isinstance(w, float):
        if not np.isfinite(w) or w < 0:
            raise ValueError(f"weight must be finite and >= 0, got {weight!r}")
        return int(w) if w.is_integer() else Fraction(w)
    return w


def integer_delta(value: np.ndarray, global_value: np.ndarray) -> np.ndarray:
    """``value - global_value`` of two integer arrays, exactly: int64 when every difference fits
    (always for dtypes up to 32 bits), else an object array of Python ints (64-bit extremes, such as
    ``2**63 - 1 - (-2**63)``). Never goes through float64 (exact at any size)."""
    v, g = np.asarray(value), np.asarray(global_value)
    if v.dtype.itemsize <= 4 and g.dtype.itemsize <= 4:
        return v.astype(np.int64) - g.astype(np.int64)
    if v.dtype == g.dtype == np.int64:
        with np.errstate(over="ignore"):
            d = v - g
        # Overflow iff the operands' signs differ and the result's sign is not the minuend's.
        if not bool((((v ^ g) & (v ^ d)) < 0).any()):
            return d
    return v.astype(object) - g.astype(object)


def _fits_int64(a: np.ndarray) -> bool:
    return a.size == 0 or (-(2**62) < int(a.min()) and int(a.max()) < 2**62)


def weighted_add(acc: np.ndarray, weight: int | Fraction, delta: np.ndarray) -> np.ndarray:
    """``acc + weight * delta`` exactly (the running sum of the integer rule): int64 while every
    partial result stays below 2**62 in magnitude, object (Python ints, or Fractions for a
    non-integral weight) beyond. Returns the new accumulator (possibly another array)."""
    if (acc.dtype == np.int64 and delta.dtype == np.int64 and isinstance(weight, int) and _fits_int64(delta)
            and _fits_int64(acc)):
        bound = max(abs(int(delta.min(initial=0))), abs(int(delta.max(initial=0)))) * weight
        if bound + max(abs(int(acc.min(initial=0))), abs(int(acc.max(initial=0)))) < 2**62:
            return acc + delta * np.int64(weight)
    return acc.astype(object) + delta.astype(object) * weight


def _exact_array(a) -> np.ndarray:
    """An int64 or object array of exact numbers (floats become exact Fractions or ints)."""
    a = np.asarray(a)
    if a.dtype.kind in "iu":
        return a.astype(np.int64) if a.dtype.itemsize <= 4 or a.dtype == np.int64 else a.astype(object)
    if a.dtype == object:
        return a
    if not np.isfinite(a).all():
        raise ValueError("integer rule: the weighted sum of changes is not finite")
    return np.vectorize(lambda x: int(x) if float(x).is_integer() else Fraction(float(x)), otypes=[object])(a) \
        if a.size else a.astype(object)


def integer_mean(global_value: np.ndarray, weighted_delta_sum: np.ndarray, total_weight,
                 remainder: np.ndarray | None = None) -> np.ndarray:
    """The integer rule: ``global + round(sum_i w_i (v_i - global) / sum_i w_i + carried remainder)``,
    clamped to the dtype; everything in exact arithmetic.

    Parameters
    ----------
    global_value : np.ndarray
        The global integer tensor (any integer dtype, any shape).
    weighted_delta_sum : np.ndarray
        Same shape: ``sum_i w_i * (v_i - global)`` over the clients aggregated, exactly (int64 or
        object array of Python ints, see `integer_delta` / `weighted_add`); float
        arrays are taken as the exact values they hold.
    total_weight : int, Fraction or float
        ``sum_i w_i`` > 0.
    remainder : np.ndarray, optional
        float64, same shape, entries in [-0.5, 0.5]: the rounding remainder carried from earlier
        rounds (error feedback for integers), updated in place. With it the global value stays
        within 0.5 of the true cumulative weighted mean at every round (a BatchNorm
        ``num_batches_tracked`` moved by 14.56 a round is 116 or 117 after 8 rounds, not 120).
        None: each round rounds on its own (no carry).

    Returns
    -------
    np.ndarray
        Same dtype and shape as ``global_value``. Rounding is half to even (``np.rint``) of the mean
        change plus the remainder; the quotient is an exact integer division, only the fraction in
        [0, 1) goes through float64, so counters beyond 2**53 move exactly (2**60 + 3 moved by +3
        by every client moves by +3). The change is applied in integer arithmetic and clamped, so an
        unchanged entry keeps its value exactly and nothing wraps around at the ends of the range
        (int64 2**63 - 1, uint64 2**64 - 1).

    Raises
    ------
    ValueError
        ``total_weight`` <= 0 or not finite.
    """
    w = exact_weight(total_weight)
    if w <= 0:
        raise ValueError(f"integer rule: total weight must be > 0, got {total_weight!r}")
    info = np.iinfo(global_value.dtype)
    total = _exact_array(weighted_delta_sum).reshape(np.shape(global_value))
    if total.dtype == np.int64 and isinstance(w, int):
        q = total // w  # floor: the fraction below is in [0, 1)
        frac = (total - q * w).astype(np.float64) / w
    else:
        q = np.asarray(total // w, dtype=object)
        rest = np.asarray(total - q * w, dtype=object).reshape(-1)
        frac = np.array([float(x / w) for x in rest], dtype=np.float64).reshape(total.shape)
    t = np.asarray(frac + (remainder if remainder is not None else 0.0), dtype=np.float64)
    base = np.floor(t)
    f = t - base
    base = base.astype(np.int64)
    # Half to even of the whole change q + t (not of t alone): a tie goes to the even result.
    odd = np.asarray((q + base) % 2 != 0, dtype=bool)
    rounded = base + ((f > 0.5) | ((f == 0.5) & odd)).astype(np.int64)
    if remainder is not None:
        remainder[...] = t - rounded
    step = q + rounded
    out = copy_array(global_value)
    moved = np.flatnonzero(step != 0)  # entries nobody changed stay exactly as they were, whatever their size
    if moved.size:
        flat, d = out.reshape(-1), np.asarray(step).reshape(-1)[moved]
        if global_value.dtype.itemsize <= 4 and d.dtype == np.int64:  # exact in int64: |g| < 2**32
            span = int(info.max) - int(info.min)
            new = flat[moved].astype(np.int64) + np.clip(d, -span, span)
            flat[moved] = np.clip(new, info.min, info.max).astype(global_value.dtype)
        else:  # Python integers, so nothing rounds or wraps at the ends of the range
            flat[moved] = [min(max(int(g) + int(x), int(info.min)), int(info.max))
                           for g, x in zip(flat[moved].tolist(), d.tolist())]
    return out


def bool_majority(global_value: np.ndarray, weight_true: np.ndarray, total_weight: float) -> np.ndarray:
    """The bool rule: True where the clients voting True hold more than half the weight, False where
    less than half; a tie keeps ``global_value``. Shapes and the bool dtype are kept."""
    out = np.where(2 * weight_true > total_weight, True, np.where(2 * weight_true < total_weight, False, global_value))
    return copy_array(out.astype(np.bool_))


__all__ = ["bool_majority", "exact_cast", "exact_weight", "integer_delta", "integer_mean", "weighted_add"]
