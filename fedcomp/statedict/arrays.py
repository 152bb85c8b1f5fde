"""Tensors as Flower ``Array``s and back, in every dtype: copies that keep each shape (0-d and
zero-element included), bfloat16 carried as raw 16-bit patterns, and the checked cast of float
values back to a tensor's own dtype (finite after the cast)."""

from __future__ import annotations

import io
import math
from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

#: ``Array.stype`` of a bfloat16 tensor carried as raw little-endian 16-bit patterns.
BF16_STYPE = "fedcomp.bfloat16"
BF16 = "bfloat16"
_FLOAT_NAMES = ("float16", "float32", "float64", BF16)
#: The half-precision float dtypes: an aggregate is rounded to them with its remainder carried.
HALF_DTYPES = ("float16", BF16)


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
    if arr.stype == "numpy.ndarray":
        _check_npy_size(arr.data)
    return arr.numpy()


def _check_npy_size(data: bytes) -> None:
    """Refuse an npy format 1.0/2.0 buffer holding fewer bytes than its header claims: ``np.load``
    allocates the claimed array before it reads (a 100-byte message claiming 10**12 floats raised
    MemoryError). Other layouts are left to ``np.load``.

    Raises
    ------
    ValueError
        The header claims more bytes than the buffer holds.
    """
    head = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(head)
        read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}[version]
        shape, _, dtype = read(head)
    except (ValueError, KeyError):
        return
    claimed = math.prod(int(d) for d in shape) * dtype.itemsize
    if claimed > len(data) - head.tell():
        raise ValueError(f"npy array claims shape {tuple(shape)} ({claimed} bytes) but holds "
                         f"{len(data) - head.tell()} bytes")


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
    """Torch tensors of an ArrayRecord written by `to_record` or Flower (bf16 restored)."""
    out = {}
    for k, a in record.items():
        v = torch.from_numpy(copy_array(array_to_numpy(a)))
        out[k] = v.to(torch.bfloat16) if a.stype == BF16_STYPE else v
    return out


def numpy_view(arr: Array) -> np.ndarray:
    """The values of a numpy-serialised Flower ``Array`` without a copy: a read-only view of its bytes
    (``np.save``'s layout: a format 1.0/2.0 header, then the data), so a model-sized message costs no
    second model in memory. Other layouts (bf16 patterns, format 3.0, a short or odd buffer) go
    through `array_to_numpy` (a copy; its errors).

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
    """`numpy_dict` without copies where it can (`numpy_view`: read-only views of the
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


def cast_carried(key: str, w: np.ndarray, dtype: str, remainder: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Round an aggregate to a half-precision ``dtype``, carrying the rounding remainder from round
    to round (error feedback for the global model, as the integer rule carries its remainder).

    Without it, a mean update below half an ulp of the model's dtype (fp16: 2**-11 at 1.0; bf16:
    2**-8) is rounded away every round and the global model stagnates; with it, the global model
    stays within half an ulp of ``sum of the aggregates + remainder`` at every round, so it moves
    as an fp32 model would (within one ulp of it).

    Parameters
    ----------
    key : str
        The tensor's name (for the message).
    w : np.ndarray
        The aggregate (global + mean update) before rounding, float32 (or float64) values.
    dtype : str
        ``"float16"`` or ``"bfloat16"``.
    remainder : np.ndarray or None
        float32 of ``w``'s shape: what earlier rounds' casts removed (None, or another shape:
        zero). Not modified.

    Returns
    -------
    (out, remainder)
        ``out`` as `cast_checked` gives it (fp16 array, or bf16-rounded float32 values) of
        ``w + remainder``; the new remainder ``w + remainder - out``, float32, ``|r| <=`` half an ulp
        of ``out`` in ``dtype``.

    Raises
    ------
    ValueError
        ``dtype`` is not half precision, or the result is not finite in ``dtype`` (naming ``key``).
    """
    if dtype not in HALF_DTYPES:
        raise ValueError(f"'{key}': cast_carried takes float16 or bfloat16, got {dtype}")
    v = np.array(w, dtype=np.float32, copy=True)
    if remainder is not None and np.shape(remainder) == v.shape:
        v += remainder
    out = cast_checked(key, v, dtype)
    v -= out.astype(np.float32)
    return out, v


__all__ = ["BF16", "BF16_STYPE", "HALF_DTYPES", "cast_carried", "array_to_numpy", "cast_checked", "copy_array",
           "dtype_limit", "is_float_dtype", "numpy_dict", "numpy_to_array", "numpy_view", "numpy_views", "to_record",
           "to_state_dict"]
