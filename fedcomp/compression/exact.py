"""Exact payloads for integer and bool tensors (BatchNorm's ``num_batches_tracked``, masks, counters).

Integer and bool tensors never go through a float codec: they travel bit-exactly, in their own
dtype, inside the same validated wire format (magic, version, codec id ``EXACT_CODEC_ID``, dtype
code, shape, then the raw little-endian elements). They are small (a ResNet-18 has 20
``num_batches_tracked`` scalars), so no compression is attempted.

Unlike [`fedcomp.compression.decompress`][] (float codecs, float32 out), `decode_exact`
returns a numpy array of the payload's own dtype, and only if it is the dtype and shape the
receiver expects.
"""

from __future__ import annotations

import numpy as np

from fedcomp.compression.errors import PayloadError
from fedcomp.compression.wire import DEFAULT_MAX_NUMEL, EXACT_DTYPE_CODES, BodyReader, pack_exact_header, parse_header

#: Codec id of exact payloads (not a `Compressor`: no float codec).
EXACT_CODEC_ID = 64
#: Name reported for exact payloads in byte statistics (``upload-bytes-exact``).
EXACT_NAME = "exact"


def is_exact_dtype(dtype) -> bool:
    """True for the integer and bool numpy dtypes that travel exactly (int8..int64, uint8..uint64, bool)."""
    return np.dtype(dtype) in EXACT_DTYPE_CODES


def encode_exact(array: np.ndarray) -> bytes:
    """Serialise an integer or bool array exactly.

    Parameters
    ----------
    array : np.ndarray
        Any shape (0-d and zero-element included); dtype int8/16/32/64, uint8/16/32/64 or bool.

    Returns
    -------
    bytes
        Header (``10 + 8*ndim`` bytes) + ``array.size * itemsize`` bytes, little-endian.

    Raises
    ------
    TypeError
        A float or other dtype (float tensors go through a codec).
    """
    a = np.asarray(array)
    if not is_exact_dtype(a.dtype):
        raise TypeError(f"exact payloads hold integer or bool arrays, got {a.dtype}")
    le = a.astype(a.dtype.newbyteorder("<"), copy=False)
    return pack_exact_header(EXACT_CODEC_ID, a.dtype, tuple(a.shape)) + np.ascontiguousarray(le).tobytes()


def decode_exact(payload: bytes | bytearray | memoryview, expected_shape: tuple[int, ...],
                 expected_dtype) -> np.ndarray:
    """Decode an exact payload, checking it against the tensor it must replace.

    Parameters
    ----------
    payload : bytes-like
        From `encode_exact` (possibly hostile).
    expected_shape : tuple of int
        Shape of the model's tensor; the header must claim exactly this (so at most its elements
        are ever allocated).
    expected_dtype : numpy dtype
        The model tensor's dtype; the payload must carry exactly this dtype.

    Returns
    -------
    np.ndarray
        A new array of ``expected_dtype`` and ``expected_shape`` (0-d stays 0-d).

    Raises
    ------
    PayloadError
        Not an exact payload, another dtype or shape, wrong body length, or bool bytes other than 0/1.
    """
    if isinstance(payload, memoryview) and not payload.c_contiguous:
        payload = payload.tobytes()
    want = np.dtype(expected_dtype)
    numel = int(np.prod(expected_shape)) if expected_shape else 1
    header = parse_header(payload, max_numel=max(numel, 1) if numel else DEFAULT_MAX_NUMEL)
    if header.codec_id != EXACT_CODEC_ID:
        raise PayloadError(f"expected an exact payload for a {want} tensor, got codec id {header.codec_id} "
                           "(integer and bool tensors must travel exactly)")
    if header.exact_dtype != want:
        raise PayloadError(f"exact payload holds {header.exact_dtype}, the model's tensor is {want}")
    if tuple(header.shape) != tuple(expected_shape):
        raise PayloadError(f"exact payload shape {header.shape} does not match the expected {tuple(expected_shape)}")
    r = BodyReader(payload, header.body_offset, EXACT_NAME)
    body = r.take(header.numel * want.itemsize, "elements")
    r.finish()
    out = np.frombuffer(body, dtype=want.newbyteorder("<")).astype(want, copy=True).reshape(header.shape)
    if want == np.bool_ and out.size and np.frombuffer(body, dtype=np.uint8).max() > 1:
        raise PayloadError("exact bool payload holds bytes other than 0 and 1")
    return out


__all__ = ["EXACT_CODEC_ID", "EXACT_NAME", "decode_exact", "encode_exact", "is_exact_dtype"]
