"""Decoding any payload: the header names the codec (`codec_name`), the registry gives its
class, and [`decompress`][fedcomp.compression.decompress] / `decompress_sparse` validate and decode; nothing but the
payload is needed.
"""

from __future__ import annotations

import numpy as np
import torch

from fedcomp.compression.errors import PayloadError
from fedcomp.compression.exact import EXACT_CODEC_ID, EXACT_NAME
from fedcomp.compression.registry import CODECS, codec_by_id
from fedcomp.compression.wire import DEFAULT_MAX_NUMEL, parse_header


def codec_name(payload: bytes) -> str:
    """Name of the codec that wrote ``payload`` (header only).

    Raises
    ------
    PayloadError
        Malformed header or unknown codec id.
    """
    header = parse_header(payload, max_numel=2**63)
    if header.codec_id == EXACT_CODEC_ID:
        return EXACT_NAME
    cls = codec_by_id(header.codec_id)
    if cls is None:
        raise PayloadError(f"unknown codec id {header.codec_id}")
    return cls.name


def _open(payload, max_numel: int, expected_shape) -> tuple:
    """``(payload, header, codec class or None)`` after the header checks shared by the decoders."""
    if isinstance(payload, memoryview) and not payload.c_contiguous:
        payload = payload.tobytes()
    header = parse_header(payload, max_numel=max_numel)
    if expected_shape is not None and tuple(header.shape) != tuple(expected_shape):
        raise PayloadError(f"payload shape {header.shape} does not match the expected {tuple(expected_shape)}")
    if header.codec_id == EXACT_CODEC_ID:
        raise PayloadError("an exact payload holds an integer/bool tensor: decode it with decode_exact, not decompress")
    cls = codec_by_id(header.codec_id)
    if cls is None:
        raise PayloadError(f"unknown codec id {header.codec_id}; known: "
                           f"{ {c.codec_id: c.name for c in CODECS.values()} }")
    if header.exact_dtype is not None:  # float codecs encode float tensors only
        raise PayloadError(f"{cls.name} payload declares dtype {header.exact_dtype}; {cls.name} encodes "
                           "float16, bfloat16, float32 or float64 tensors only")
    return payload, header, cls


def decompress(
    payload: bytes | bytearray | memoryview,
    *,
    max_numel: int = DEFAULT_MAX_NUMEL,
    expected_shape: tuple[int, ...] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode any fedcomp payload; needs nothing but the payload.

    Parameters
    ----------
    payload : bytes-like
        Bytes produced by ``Compressor.compress`` (possibly from an untrusted peer).
    max_numel : int
        Refuse payloads that claim more elements than this (decompression-bomb guard),
        checked from the header before anything is allocated. Default 2**28.
    expected_shape : tuple of int, optional
        If given, the header's shape must equal it (checked before decoding the body).
    out : torch.Tensor, optional
        Decode into this caller's buffer instead of a fresh tensor (a server reusing one buffer
        for every reply saves the allocation and its page faults): a contiguous CPU tensor of
        ``numel`` entries (any shape), float32 (float64 for a ``none`` payload of a float64
        tensor). Checked against the header before the body is read. It may share memory with
        the payload (the payload's bytes are then copied before ``out`` is written). If decoding
        raises, its contents are unspecified.

    Returns
    -------
    torch.Tensor
        float32 CPU tensor of the original shape (float64 for a ``none`` payload of a float64
        tensor: such models stay float64 end to end); always finite. With ``out``: ``out`` itself,
        its shape unchanged.

    Raises
    ------
    PayloadError
        Truncated, bad magic, unknown codec or version, an exact payload, a header dtype the
        codec cannot produce (an integer dtype on a float codec), too many elements, shape other
        than ``expected_shape``, position out of range, non-finite scale or values,
        trailing bytes. Nothing is pickled or ``torch.load``-ed.
    TypeError
        ``out`` is not a torch tensor.
    ValueError
        ``out`` is not a contiguous float32/float64 CPU tensor of the payload's number of entries,
        or not of the dtype the payload decodes to.
    """
    payload, header, cls = _open(payload, max_numel, expected_shape)
    view = memoryview(payload).cast("B")
    if out is not None:
        flat = _out_array(out, header.numel)
        if flat.size and view.nbytes and np.may_share_memory(flat, np.frombuffer(view, dtype=np.uint8)):
            view = memoryview(view.tobytes())  # out overlaps the payload: decode from a copy of its bytes
        with np.errstate(over="ignore", invalid="ignore"):
            cls._decode_into(header, view, flat)
    else:
        with np.errstate(over="ignore", invalid="ignore"):  # overflow shows up as non-finite output, checked below
            flat = cls._decode(header, view)
    wide = flat.dtype == np.float64 and header.dtype == torch.float64  # only `none` of a float64 tensor
    if flat.shape != (header.numel,) or (flat.dtype != np.float32 and not wide):  # pragma: no cover - invariant
        raise PayloadError(f"{cls.name} decoder produced {flat.shape} {flat.dtype}")
    if not all_finite(flat):
        raise PayloadError(f"{cls.name} payload decodes to non-finite values")
    return out if out is not None else torch.from_numpy(flat).reshape(header.shape)


def _out_array(out, numel: int) -> np.ndarray:
    """``decompress``'s ``out`` as a flat numpy view, after the checks its docstring names."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"decompress: out must be a torch.Tensor, got {type(out).__name__}")
    if out.device.type != "cpu" or out.dtype not in (torch.float32, torch.float64) or not out.is_contiguous():
        raise ValueError(f"decompress: out must be a contiguous float32 or float64 CPU tensor, got {out.dtype} "
                         f"on {out.device}{'' if out.is_contiguous() else ' (not contiguous)'}")
    if out.numel() != numel:
        raise ValueError(f"decompress: out has {out.numel()} entries, the payload {numel}")
    return out.detach().numpy().reshape(-1)


def all_finite(a: np.ndarray) -> bool:
    """Whether every entry of a float array is finite: one summing pass (NaN and +-Inf propagate
    into the sum), and the elementwise check only when the sum is not finite (perhaps a mere
    overflow)."""
    if a.size == 0:
        return True
    if not a.flags.writeable:  # torch.from_numpy wants a writable array
        return bool(np.isfinite(a).all())
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(torch.from_numpy(a).sum().item()):
            return True
    return bool(np.isfinite(a).all())


def decompress_sparse(
    payload: bytes | bytearray | memoryview,
    *,
    max_numel: int = DEFAULT_MAX_NUMEL,
    expected_shape: tuple[int, ...] | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Decode a sparse payload (stc, topk, randomk) to its kept entries, without a dense output.

    Validation is [`decompress`][fedcomp.compression.decompress]'s. Used by the server to fold a sparse update into a
    running sum in O(k) (scatter-add of the kept entries).

    Parameters
    ----------
    payload : bytes-like
        Possibly untrusted bytes.
    max_numel, expected_shape
        As in [`decompress`][fedcomp.compression.decompress].

    Returns
    -------
    (positions, values) or None
        ``positions``: int64, shape ``(k,)``, strictly increasing, each in ``[0, numel)`` of the
        flattened tensor; ``values``: float32, shape ``(k,)``, finite. None if the payload's codec
        is dense (sign, qsgd, int8, fp16, ...): decode it with [`decompress`][fedcomp.compression.decompress]. Memory is
        O(k) for every sparse codec (randomk regenerates its k positions without an n-sized mask when
        k <= n / 4).

    Raises
    ------
    PayloadError
        As [`decompress`][fedcomp.compression.decompress]: an unknown codec id, an exact (integer/bool) payload and a
        float codec's header that declares an integer dtype are refused, never answered with None.
    """
    payload, header, cls = _open(payload, max_numel, expected_shape)
    if not hasattr(cls, "_decode_sparse"):
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        pos, vals = cls._decode_sparse(header, memoryview(payload).cast("B"))
    pos = np.asarray(pos, dtype=np.int64)
    vals = np.asarray(vals, dtype=np.float32)
    if pos.shape != vals.shape or pos.ndim != 1:  # pragma: no cover - decoder invariant
        raise PayloadError(f"{cls.name} decoder produced {pos.shape} positions for {vals.shape} values")
    if len(pos) and (pos[0] < 0 or pos[-1] >= header.numel or (len(pos) > 1 and not bool((np.diff(pos) > 0).all()))):
        raise PayloadError(f"{cls.name} positions are not strictly increasing within [0, {header.numel})")
    if not np.isfinite(vals).all():
        raise PayloadError(f"{cls.name} payload decodes to non-finite values")
    return pos, vals



__all__ = ["all_finite", "codec_name", "decompress", "decompress_sparse"]
