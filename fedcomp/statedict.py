"""One home for state_dict handling: which tensors are float updates, which travel exactly, how an
update is applied per dtype, and copies that keep every shape (0-d and zero-element included).

Used by the client mod, the legacy client, decoding, aggregation, downstream compression and
checkpoints alike. The rules (stated in the README, "Use with your existing Flower app"):

- **Float tensors** (fp16, bf16, fp32, fp64 parameters and buffers such as BatchNorm's running
  mean/var) are updates like any other: ``delta = trained - received`` in float32, compressed by
  the codec. Applying an update happens in float32 and the result is cast back to the tensor's
  own dtype; it must be finite *after* that cast (an fp16 update that overflows 65504 is refused).
- **Integer and bool tensors** (BatchNorm's int64 ``num_batches_tracked``, masks, counters) never
  go through a float codec: clients send their value exactly (:mod:`fedcomp.compression.exact`)
  and the server aggregates them by :func:`integer_mean` (weighted mean of the clients' values in
  exact integer arithmetic, rounded half to even with the rounding remainder carried from round to
  round, clamped to the dtype's range) or :func:`bool_majority` (weighted
  majority; a tie keeps the global value). They never enter a float codec's whole-model vector
  nor a clipping norm.
- **bfloat16**: numpy has no bfloat16 and Flower's ``ArrayRecord(state_dict)`` refuses it, so
  :func:`to_record` carries bf16 tensors as raw 16-bit patterns (``stype = BF16_STYPE``) and
  :func:`to_state_dict` restores them; in numpy they are float32 values (exactly representable).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

#: ``Array.stype`` of a bfloat16 tensor carried as raw little-endian 16-bit patterns.
BF16_STYPE = "fedcomp.bfloat16"
BF16 = "bfloat16"
_FLOAT_NAMES = ("float16", "float32", "float64", BF16)


def copy_array(a) -> np.ndarray:
    """A C-contiguous copy that keeps the shape exactly (``np.ascontiguousarray`` turns 0-d into ``(1,)``)."""
    return np.array(a, copy=True, order="C")


def is_float_dtype(dtype: str | np.dtype) -> bool:
    """True for float16/bfloat16/float32/float64 (updates), False for integer and bool (sent exactly).

    Raises
    ------
    TypeError
        Complex, string, object or any other dtype a model tensor cannot usefully have here.
    """
    name = str(dtype)
    if name in _FLOAT_NAMES:
        return True
    dt = np.dtype(name)
    if dt.kind in "iub":
        return False
    raise TypeError(f"unsupported tensor dtype {name}: fedcomp handles float, integer and bool tensors")


def array_to_numpy(arr: Array) -> np.ndarray:
    """The values of a Flower ``Array`` as numpy (bf16 -> float32 values, exactly).

    Raises
    ------
    TypeError
        An Array that is neither numpy-serialised nor a bf16 pattern (e.g. a fedcomp payload).
    """
    if arr.stype == BF16_STYPE:
        n = int(np.prod(arr.shape)) if arr.shape else 1
        bits = np.frombuffer(arr.data, dtype="<u2")
        if bits.size != n:
            raise ValueError(f"bfloat16 array claims shape {tuple(arr.shape)} but holds {bits.size} values")
        return (bits.astype(np.uint32) << 16).view(np.float32).reshape(tuple(arr.shape))
    return arr.numpy()


def numpy_to_array(values: np.ndarray, dtype: str) -> Array:
    """A Flower ``Array`` of ``values`` in ``dtype`` (``"bfloat16"``: rounded to bf16, carried as bits)."""
    if dtype == BF16:
        t = torch.from_numpy(np.asarray(values, dtype=np.float32).copy()).to(torch.bfloat16)
        bits = t.view(torch.int16).numpy().astype("<i2")
        return Array(dtype=BF16, shape=tuple(int(d) for d in values.shape), stype=BF16_STYPE, data=bits.tobytes())
    return Array(copy_array(np.asarray(values).astype(dtype, copy=False)))


def to_record(state_dict: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """``ArrayRecord`` of a model's ``state_dict()``, bf16 tensors included (Flower's own refuses them).

    Parameters
    ----------
    state_dict : mapping of str to torch.Tensor
        Any dtypes and shapes (0-d, zero-element); tensors on any device (copied to CPU).
    """
    out = ArrayRecord()
    for k, t in state_dict.items():
        t = t.detach().cpu()
        out[k] = numpy_to_array(t.float().numpy(), BF16) if t.dtype == torch.bfloat16 else Array(copy_array(t.numpy()))
    return out


def to_state_dict(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """Torch tensors of an ArrayRecord written by :func:`to_record` or Flower (bf16 restored)."""
    out = {}
    for k, a in record.items():
        v = torch.from_numpy(copy_array(array_to_numpy(a)))
        out[k] = v.to(torch.bfloat16) if a.stype == BF16_STYPE else v
    return out


def numpy_view(arr: Array) -> np.ndarray:
    """The values of a numpy-serialised Flower ``Array`` without a copy: a read-only view of its bytes
    (``np.save``'s layout: a format 1.0/2.0 header, then the data), so a model-sized message costs no
    second model in memory. Other layouts (bf16 patterns, format 3.0, a short or odd buffer) go
    through :func:`array_to_numpy` (a copy; its errors).

    Returns
    -------
    np.ndarray
        Shape and dtype of the serialised array; ``flags.writeable`` is False for a view.
    """
    if arr.stype != "numpy.ndarray":
        return array_to_numpy(arr)
    head = io.BytesIO(arr.data)  # shares the bytes (CPython copies a BytesIO's buffer only when written)
    try:
        version = np.lib.format.read_magic(head)
        read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}[version]
        shape, fortran, dtype = read(head)
        if dtype.hasobject:
            raise ValueError("object arrays are not read")
        n = int(np.prod(shape)) if shape else 1
        view = np.frombuffer(arr.data, dtype=dtype, count=n, offset=head.tell())
    except (ValueError, KeyError):
        return array_to_numpy(arr)
    return view.reshape(shape, order="F" if fortran else "C")


def numpy_views(record: ArrayRecord) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """:func:`numpy_dict` without copies where it can (:func:`numpy_view`: read-only views of the
    record's bytes, valid while the record lives). For the client, which only reads them."""
    values = {k: numpy_view(a) for k, a in record.items()}
    return values, {k: (BF16 if a.stype == BF16_STYPE else a.dtype or str(values[k].dtype)) for k, a in record.items()}


def numpy_dict(record: ArrayRecord) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Values (bf16 as float32) and dtype names of every Array of ``record``, in its key order."""
    return ({k: array_to_numpy(a) for k, a in record.items()},
            {k: (BF16 if a.stype == BF16_STYPE else str(a.numpy().dtype) if not a.dtype else a.dtype)
             for k, a in record.items()})


def dtype_limit(dtype: str) -> float:
    """Largest finite magnitude of a float dtype (fp16 65504, bf16 ~3.39e38, fp32 ~3.40e38)."""
    if dtype == BF16:
        return float(torch.finfo(torch.bfloat16).max)
    return float(np.finfo(np.dtype(dtype)).max)


def cast_checked(key: str, w: np.ndarray, dtype: str) -> np.ndarray:
    """Cast float32 weights ``w`` to the tensor's ``dtype`` (bf16: rounded, kept as float32 values).

    Raises
    ------
    ValueError
        The result is not finite in ``dtype`` (NaN, Inf, or beyond its range, e.g. > 65504 in fp16).
    """
    if dtype == BF16:
        out = torch.from_numpy(np.asarray(w, dtype=np.float32)).to(torch.bfloat16).float().numpy()
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            out = np.asarray(w).astype(dtype)
    if out.size and not np.isfinite(out).all():
        raise ValueError(f"'{key}': global + update is not finite in the model's dtype {dtype}")
    return out


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
        object array of Python ints, see :func:`integer_delta` / :func:`weighted_add`); float
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


@dataclass(frozen=True)
class Spec:
    """Shape and dtype name (numpy name or ``"bfloat16"``) of one model tensor."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        """Number of elements (1 for a 0-d tensor, 0 for a zero-element one)."""
        return int(np.prod(self.shape)) if self.shape else 1

    @property
    def is_float(self) -> bool:
        """Whether the tensor carries a float update (else it travels exactly)."""
        return is_float_dtype(self.dtype)


class FlatModel:
    """A model's tensors split into one flat float vector of every float tensor (model order) and
    the exact (integer/bool) tensors; per-key float views share the flat vector's memory.

    The flat vector is float32, or float64 when the model has a float64 tensor: a float64 model
    stays float64 end to end (global copy, decoded ``none`` updates, the running sum, hand-over),
    so an untouched pi or 1e9 + 0.5 comes back bit for bit.

    This is how the server holds the global model it sent in a round and how aggregation addresses
    float entries: a whole-model payload (selection "model") covers the float tensors not sent on
    their own, concatenated in model order, which :meth:`segments` maps to flat offsets.

    Parameters
    ----------
    values : dict of str to np.ndarray
        The model in key order (bf16 tensors as float32 values).
    dtypes : dict of str to str
        Each tensor's dtype name (``"bfloat16"`` for bf16).
    """

    def __init__(self, values: Mapping[str, np.ndarray], dtypes: Mapping[str, str]) -> None:
        self.keys = list(values)
        self.specs = {k: Spec(tuple(int(d) for d in np.shape(values[k])), str(dtypes[k])) for k in self.keys}
        self.float_keys = [k for k in self.keys if self.specs[k].is_float]
        self.exact_keys = [k for k in self.keys if not self.specs[k].is_float]
        self.offsets: dict[str, int] = {}
        off = 0
        for k in self.float_keys:
            self.offsets[k] = off
            off += self.specs[k].numel
        self.num_float = off
        #: float32, or float64 when the model has a float64 tensor (then kept exactly).
        self.wide = any(self.specs[k].dtype == "float64" for k in self.float_keys)
        self.flat = np.empty(off, dtype=np.float64 if self.wide else np.float32)
        for k in self.float_keys:
            self.flat[self.offsets[k]: self.offsets[k] + self.specs[k].numel] = np.asarray(values[k]).reshape(-1)
        self.exact = {k: copy_array(values[k]) for k in self.exact_keys}
        self._starts = np.array([self.offsets[k] for k in self.float_keys], dtype=np.int64)
        self._limits = np.array([dtype_limit(self.specs[k].dtype) for k in self.float_keys], dtype=np.float64)
        self._uniform = float(self._limits[0]) if len(self._limits) and (self._limits == self._limits[0]).all() else None
        self.dense_bytes = 4 * self.num_float + sum(v.nbytes for v in self.exact.values())

    def key_at(self, flat_index: int) -> str:
        """The float tensor holding entry ``flat_index`` of :attr:`flat`."""
        return self.float_keys[int(np.searchsorted(self._starts, flat_index, side="right")) - 1]

    def limits_at(self, flat_positions: np.ndarray) -> float | np.ndarray:
        """Largest finite magnitude of the dtype at each flat position (a scalar if all dtypes agree)."""
        if self._uniform is not None:
            return self._uniform
        return self._limits[np.searchsorted(self._starts, flat_positions, side="right") - 1]

    @classmethod
    def from_record(cls, record: ArrayRecord) -> FlatModel:
        """From an ArrayRecord of dense weights (Flower's or :func:`to_record`'s)."""
        values, dtypes = numpy_dict(record)
        return cls(values, dtypes)

    @classmethod
    def from_numpy(cls, values: Mapping[str, np.ndarray]) -> FlatModel:
        """From numpy arrays, each tensor's dtype its array's (no bf16: numpy has none)."""
        return cls(values, {k: str(np.asarray(v).dtype) for k, v in values.items()})

    def float_view(self, key: str) -> np.ndarray:
        """The values of float tensor ``key`` (:attr:`flat`'s dtype), shaped (a view into :attr:`flat`)."""
        o = self.offsets[key]
        return self.flat[o: o + self.specs[key].numel].reshape(self.specs[key].shape)

    def value(self, key: str) -> np.ndarray:
        """Tensor ``key`` as numpy: float32 values (a view) for float tensors, the exact array otherwise."""
        return self.float_view(key) if key in self.offsets else self.exact[key]

    def __getitem__(self, key: str) -> np.ndarray:
        return self.value(key)

    def items(self):
        """``(key, value)`` pairs in model order (float tensors as float32 views)."""
        return ((k, self.value(k)) for k in self.keys)

    def segments(self, members: list[str]) -> list[tuple[int, int, int]]:
        """``[(local start, flat start, length), ...]`` of a unit concatenating ``members`` (float keys)."""
        out, local = [], 0
        for k in members:
            n = self.specs[k].numel
            out.append((local, self.offsets[k], n))
            local += n
        return out

    def _apply(self, key: str, update, scale: float, chunk: int = 1 << 18) -> np.ndarray:
        """``global + scale * update`` of one tensor in :attr:`flat`'s dtype, in chunks (temporaries stay
        small). ``update``: the flat vector, or a dict of per-tensor flat arrays (an entry is
        dropped once used, so a per-tensor accumulator shrinks as the record grows)."""
        spec, o = self.specs[key], self.offsets[key]
        if isinstance(update, dict):
            src, base = update.pop(key), 0
        else:
            src, base = update, o
        out = np.empty(spec.numel, dtype=self.flat.dtype)
        g = self.flat[o: o + spec.numel]
        for i in range(0, spec.numel, chunk):
            part = src[base + i: base + min(i + chunk, spec.numel)]
            out[i: i + part.size] = g[i: i + part.size] + (part * scale if scale != 1.0 else part)
        return out.reshape(spec.shape)

    def record(self, flat_update: np.ndarray | None = None, exact: Mapping[str, np.ndarray] | None = None,
               check: bool = True, portable: bool = False, scale: float = 1.0) -> ArrayRecord:
        """Dense weights ``global + flat_update`` in every tensor's own dtype and shape.

        Parameters
        ----------
        flat_update : np.ndarray or dict, optional
            float32 or float64, shape ``(num_float,)``, or ``{float key: flat array}`` (consumed:
            each entry is removed once applied); None: the global values.
        scale : float
            Multiplies ``flat_update`` (e.g. 1 / total weight of a running sum), per tensor, so
            that no scaled copy of the whole vector is made.
        exact : dict, optional
            Replacement values of exact tensors (default: the global ones).
        check : bool
            Refuse non-finite results after the cast (naming the key).
        portable : bool
            Give bf16 tensors as float32 numpy Arrays (for Flower strategies, which call
            ``Array.numpy()``); the caller casts back.

        Raises
        ------
        ValueError
            A float tensor that is not finite after the cast to its dtype.
        """
        out = ArrayRecord()
        for k in self.keys:
            spec = self.specs[k]
            if spec.is_float:
                w = self.float_view(k)
                if flat_update is not None:
                    w = self._apply(k, flat_update, scale)
                w = cast_checked(k, w, spec.dtype) if check else w
                out[k] = numpy_to_array(w, "float32" if portable and spec.dtype == BF16 else spec.dtype)
            else:
                v = self.exact[k] if exact is None or k not in exact else exact[k]
                out[k] = Array(copy_array(v))
        return out


__all__ = ["BF16", "BF16_STYPE", "FlatModel", "Spec", "array_to_numpy", "bool_majority", "cast_checked",
           "copy_array", "dtype_limit", "exact_cast", "exact_weight", "integer_delta", "integer_mean", "is_float_dtype", "numpy_dict", "numpy_to_array", "numpy_view", "numpy_views",
           "to_record", "to_state_dict", "weighted_add"]
