"""The fedcomp wire format: a fixed, self-describing header followed by a codec body.

Layout (all integers little-endian):

    offset  size        field
    0       4           magic b"FCMP"
    4       1           format version (currently 1)
    5       1           codec id (Compressor.codec_id, see registry.register)
    6       1           dtype code of the original tensor (0 fp32, 1 fp16, 2 bf16, 3 fp64; exact
                        payloads of integer/bool tensors: 16.. int8..int64, uint8..uint64, bool)
    7       1           ndim (0..MAX_NDIM)
    8       8*ndim      shape, one uint64 per dimension
    ...     2           params_len (uint16)
    ...     params_len  codec parameters (a fixed struct layout per codec)
    ...     rest        body (codec-specific; its exact length follows from the header)

The header costs ``10 + 8*ndim + params_len`` bytes. Decoding reads only this module's
header and the codec's own validated body: no pickle, no ``torch.load``.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import torch

from fedcomp.compression.errors import PayloadError

MAGIC = b"FCMP"
FORMAT_VERSION = 1
MAX_NDIM = 32
#: Default cap on the number of elements a payload may claim (2**28 floats = 1 GiB fp32).
#: Pass ``max_numel`` to `decompress` to raise or lower it.
DEFAULT_MAX_NUMEL = 2**28

_FIXED = struct.Struct("<4sBBBB")

#: Value encodings a codec may declare in its parameters (top-k's values, PowerSGD's factors):
#: name -> (code in the parameters, numpy dtype, bytes per value).
VALUE_DTYPES = {"fp32": (0, np.float32, 4), "fp16": (1, np.float16, 2)}
#: code -> (name, numpy dtype, bytes per value).
VALUE_DTYPE_BY_CODE = {code: (name, dt, size) for name, (code, dt, size) in VALUE_DTYPES.items()}

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float64: 3,
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
#: numpy dtypes of exact payloads (integer and bool tensors, see ``fedcomp.compression.exact``).
EXACT_DTYPE_CODES: dict[np.dtype, int] = {
    np.dtype(t): 16 + i for i, t in enumerate(
        (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64, np.bool_))
}
CODE_EXACT_DTYPES = {v: k for k, v in EXACT_DTYPE_CODES.items()}


@dataclass(frozen=True)
class Header:
    """Parsed payload header.

    Attributes
    ----------
    codec_id : int
        Registered codec id (0..255).
    dtype : torch.dtype
        dtype of the tensor that was compressed (decoding always yields float32).
    shape : tuple[int, ...]
        Shape of the original tensor.
    params : bytes
        Raw codec parameters; the codec's decoder unpacks and validates them.
    body_offset : int
        Byte offset of the body inside the payload.
    exact_dtype : numpy dtype or None
        The integer/bool dtype of an exact payload (then ``dtype`` is float32, unused); None otherwise.
    """

    codec_id: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    params: bytes
    body_offset: int
    exact_dtype: np.dtype | None = None

    @property
    def numel(self) -> int:
        """Number of elements the payload decodes to (product of ``shape``; 1 for 0-d)."""
        return math.prod(self.shape)


def pack_header(codec_id: int, dtype: torch.dtype, shape: tuple[int, ...], params: bytes) -> bytes:
    """Serialise a header.

    Parameters
    ----------
    codec_id : int
        Codec id, 0..255.
    dtype : torch.dtype
        One of float32, float16, bfloat16, float64.
    shape : tuple of int
        Tensor shape, at most ``MAX_NDIM`` dimensions.
    params : bytes
        Codec parameters, at most 65535 bytes.

    Returns
    -------
    bytes
        ``10 + 8*len(shape) + len(params)`` bytes.

    Raises
    ------
    ValueError
        If the dtype is unsupported or the shape has too many dimensions.
    """
    if dtype not in DTYPE_CODES:
        raise ValueError(f"unsupported dtype {dtype}; expected one of {list(DTYPE_CODES)}")
    if len(shape) > MAX_NDIM:
        raise ValueError(f"tensor has {len(shape)} dimensions; at most {MAX_NDIM} are supported")
    if len(params) > 0xFFFF:
        raise ValueError("codec parameters exceed 65535 bytes")
    return b"".join(
        (
            _FIXED.pack(MAGIC, FORMAT_VERSION, codec_id, DTYPE_CODES[dtype], len(shape)),
            struct.pack(f"<{len(shape)}Q", *shape),
            struct.pack("<H", len(params)),
            params,
        )
    )


def pack_exact_header(codec_id: int, dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """Serialise the header of an exact (integer/bool) payload; as `pack_header`, no params.

    Raises
    ------
    ValueError
        A dtype outside `EXACT_DTYPE_CODES` or too many dimensions.
    """
    if np.dtype(dtype) not in EXACT_DTYPE_CODES:
        raise ValueError(f"unsupported exact dtype {dtype}; expected one of {list(EXACT_DTYPE_CODES)}")
    if len(shape) > MAX_NDIM:
        raise ValueError(f"tensor has {len(shape)} dimensions; at most {MAX_NDIM} are supported")
    return b"".join((_FIXED.pack(MAGIC, FORMAT_VERSION, codec_id, EXACT_DTYPE_CODES[np.dtype(dtype)], len(shape)),
                     struct.pack(f"<{len(shape)}Q", *shape), struct.pack("<H", 0)))


def parse_header(payload: bytes | bytearray | memoryview, max_numel: int = DEFAULT_MAX_NUMEL) -> Header:
    """Parse and validate a payload header without touching the body.

    Parameters
    ----------
    payload : bytes-like
        A complete payload.
    max_numel : int
        Largest element count the payload may claim; checked here, before any allocation.

    Returns
    -------
    Header

    Raises
    ------
    PayloadError
        Truncated header, bad magic, unsupported version, unknown dtype code, too many
        dimensions, or a claimed element count above ``max_numel``.
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise PayloadError(f"payload must be bytes, got {type(payload).__name__}")
    mv = memoryview(payload).cast("B")
    if len(mv) < _FIXED.size:
        raise PayloadError(f"truncated: header needs {_FIXED.size} bytes, payload has {len(mv)}")
    magic, version, codec_id, dtype_code, ndim = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise PayloadError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a fedcomp payload")
    if version != FORMAT_VERSION:
        raise PayloadError(f"unsupported format version {version} (this decoder reads {FORMAT_VERSION})")
    if dtype_code not in CODE_DTYPES and dtype_code not in CODE_EXACT_DTYPES:
        raise PayloadError(f"unknown dtype code {dtype_code}")
    if ndim > MAX_NDIM:
        raise PayloadError(f"ndim {ndim} exceeds the maximum of {MAX_NDIM}")
    off = _FIXED.size
    need = off + 8 * ndim + 2
    if len(mv) < need:
        raise PayloadError(f"truncated: header with {ndim} dims needs {need} bytes, payload has {len(mv)}")
    shape = struct.unpack_from(f"<{ndim}Q", mv, off)
    off += 8 * ndim
    # A zero-element shape such as (0, 5) allocates nothing: its other dimensions may exceed max_numel
    # (up to DEFAULT_MAX_NUMEL), never 2**63.
    dim_limit = max(max_numel, 1) if 0 not in shape else max(max_numel, DEFAULT_MAX_NUMEL)
    if any(d > dim_limit for d in shape):
        raise PayloadError(f"payload claims a dimension of {max(shape)} elements, above the limit of {dim_limit}")
    numel = 1
    for d in shape:  # loop over <= 32 dims, with an early exit: no overflowing product
        numel *= d
        if numel > max_numel:
            raise PayloadError(
                f"payload claims shape {tuple(shape)} ({math.prod(shape)} elements), "
                f"above the limit of {max_numel} elements"
            )
    (plen,) = struct.unpack_from("<H", mv, off)
    off += 2
    if len(mv) < off + plen:
        raise PayloadError(f"truncated: codec parameters need {plen} bytes, {len(mv) - off} left")
    params = bytes(mv[off : off + plen])
    return Header(int(codec_id), CODE_DTYPES.get(dtype_code, torch.float32), tuple(int(d) for d in shape), params,
                  off + plen, CODE_EXACT_DTYPES.get(dtype_code))


class BodyReader:
    """Sequential reader over a payload body that checks every length before slicing.

    Parameters
    ----------
    payload : bytes-like
        The whole payload.
    offset : int
        Where the body starts.
    codec : str
        Codec name, used in error messages.
    """

    def __init__(self, payload: bytes | bytearray | memoryview, offset: int, codec: str) -> None:
        self._mv = memoryview(payload).cast("B")
        self._off = offset
        self._codec = codec

    def take(self, nbytes: int, what: str) -> memoryview:
        """Return the next ``nbytes`` bytes.

        Raises
        ------
        PayloadError
            If fewer than ``nbytes`` bytes remain (``what`` names the field).
        """
        left = len(self._mv) - self._off
        if nbytes < 0 or nbytes > left:
            raise PayloadError(f"truncated: {self._codec} {what} need {nbytes} bytes, {left} left")
        out = self._mv[self._off : self._off + nbytes]
        self._off += nbytes
        return out

    def finish(self) -> None:
        """Check that the body was consumed exactly.

        Raises
        ------
        PayloadError
            If bytes remain after the last field ("trailing bytes").
        """
        left = len(self._mv) - self._off
        if left:
            raise PayloadError(f"{left} trailing bytes after the {self._codec} body")


def unpack_params(fmt: str, params: bytes, codec: str) -> tuple:
    """Unpack a codec's fixed ``struct`` parameter block.

    Raises
    ------
    PayloadError
        If ``params`` does not have exactly ``struct.calcsize(fmt)`` bytes.
    """
    size = struct.calcsize(fmt)
    if len(params) != size:
        raise PayloadError(f"{codec} parameters must be {size} bytes, got {len(params)}")
    return struct.unpack(fmt, params)
