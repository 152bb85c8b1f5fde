"""A model as one flat float vector of its float tensors (model order) beside its exact tensors:
how the server holds the global model of a round and addresses float entries by flat offset."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord

from fedcomp.statedict.arrays import (
    HALF_DTYPES,
    cast_checked,
    copy_array,
    dtype_limit,
    is_float_dtype,
    numpy_dict,
    numpy_to_array,
)


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
    their own, concatenated in model order, which `segments` maps to flat offsets.

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
        self._uniform = (float(self._limits[0]) if len(self._limits) and (self._limits == self._limits[0]).all()
                         else None)
        self.dense_bytes = 4 * self.num_float + sum(v.nbytes for v in self.exact.values())

    def key_at(self, flat_index: int) -> str:
        """The float tensor holding entry ``flat_index`` of `flat`."""
        return self.float_keys[int(np.searchsorted(self._starts, flat_index, side="right")) - 1]

    def limits_at(self, flat_positions: np.ndarray) -> float | np.ndarray:
        """Largest finite magnitude of the dtype at each flat position (a scalar if all dtypes agree)."""
        if self._uniform is not None:
            return self._uniform
        return self._limits[np.searchsorted(self._starts, flat_positions, side="right") - 1]

    @classmethod
    def from_record(cls, record: ArrayRecord) -> FlatModel:
        """From an ArrayRecord of dense weights (Flower's or `to_record`'s)."""
        values, dtypes = numpy_dict(record)
        return cls(values, dtypes)

    @classmethod
    def from_numpy(cls, values: Mapping[str, np.ndarray]) -> FlatModel:
        """From numpy arrays, each tensor's dtype its array's (no bf16: numpy has none)."""
        return cls(values, {k: str(np.asarray(v).dtype) for k, v in values.items()})

    def float_view(self, key: str) -> np.ndarray:
        """The values of float tensor ``key`` (`flat`'s dtype), shaped (a view into `flat`)."""
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
        """``global + scale * update`` of one tensor in `flat`'s dtype, in chunks (temporaries stay
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
            Give fp16 and bf16 tensors as float32 numpy Arrays, unrounded (for Flower strategies,
            which call ``Array.numpy()``, and so that the caller rounds the aggregate once, carrying
            the remainder: `fedcomp.statedict.cast_carried`); the caller casts back.

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
                out[k] = numpy_to_array(w, "float32" if portable and spec.dtype in HALF_DTYPES else spec.dtype)
            else:
                v = self.exact[k] if exact is None or k not in exact else exact[k]
                out[k] = Array(copy_array(v))
        return out


__all__ = ["FlatModel", "Spec"]
