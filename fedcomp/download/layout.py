"""Pieces of the downstream (server-to-client) protocol both sides need (Flower-free).

A downstream message splits a model's float tensors into the *compressed part* (one flat float32
vector, model order, changed by compressed payloads) and the *exempt part* (BatchNorm running
statistics unless ``batchnorm-stats = "codec"``: with "small", sent exactly in every message, like
the integer and bool tensors; with "auto", the default, a node that holds a copy gets each
statistic's change since that copy as a scaled-sign payload under `stat_delta_key`, applied
by `apply_stat_delta` on both sides, so the server knows each node's copy bit for bit). The server's
`fedcomp.download.sender` writes messages, `fedcomp.download.receiver` reads them.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable

import numpy as np
import torch

from fedcomp.compression import PayloadError, decompress
from fedcomp.download import shared_step
from fedcomp.protocol.messages import MODEL_KEY
from fedcomp.statedict import BF16, FlatModel


def is_batchnorm_stat(key: str) -> bool:
    """True for BatchNorm's float statistics in a state_dict: ``<module>.running_mean`` /
    ``<module>.running_var`` (the names ``torch.nn.modules.batchnorm`` registers)."""
    return key.rsplit(".", 1)[-1] in ("running_mean", "running_var")


#: Prefix of the ArrayRecord key of a BatchNorm statistic's change (``batchnorm-stats = "auto"``).
STAT_DELTA_PREFIX = "fedcomp.stat-delta/"


#: A running variance falls at most to this fraction of its previous value in one lossy exchange (a
#: scaled sign's change is one magnitude per tensor: it can undershoot a small variance to <= 0, and a
#: variance of 0 makes BatchNorm's output ``x / sqrt(eps)``); what is held back arrives in later rounds.
VAR_FLOOR = 0.5


def is_running_var(key: str) -> bool:
    """True for BatchNorm's running variance (``<module>.running_var``): never below zero."""
    return key.rsplit(".", 1)[-1] == "running_var"


def stat_delta_key(key: str) -> str:
    """ArrayRecord key of the change of BatchNorm statistic ``key`` in a downstream message."""
    return STAT_DELTA_PREFIX + key


def apply_stat_delta(model: FlatModel, key: str, change: np.ndarray) -> None:
    """``key``'s values += ``change`` (float32, the tensor's shape or flat) in place: added in float32
    (float64 for a float64 tensor) whatever the model's flat dtype; a running variance then kept at
    >= `VAR_FLOOR` times its previous value (so >= 0: a lossy change can undershoot); then
    rounded to the tensor's dtype (`round_to_dtypes`). The server applies it to its record of a node's
    copy, the node to its copy: the same float operations, so both copies stay equal bit for bit."""
    view = model.float_view(key).reshape(-1)
    wide = np.float64 if model.specs[key].dtype == "float64" else np.float32  # not the flat's: the tensor's
    vec = view.astype(wide) + change.reshape(-1).astype(wide)
    if is_running_var(key):
        np.maximum(vec, view.astype(wide) * VAR_FLOOR, out=vec)
    view[...] = round_to_dtypes(model, [key], vec)


def chain_key(i: int) -> str:
    """ArrayRecord key of the ``i``-th compressed payload of a message (applied in order, from 0)."""
    return MODEL_KEY if i == 0 else f"{MODEL_KEY}/{i}"


#: First bytes of a compressed step sent per tensor (`encode_per_tensor`); a step of the whole
#: vector is one fedcomp payload and starts with the wire format's ``b"FCMP"``.
PER_TENSOR_MAGIC = b"FCPT"
_COUNT = struct.Struct("<I")


def encode_per_tensor(compress: Callable[[int, np.ndarray], bytes], vec: np.ndarray, sizes: list[int]) -> bytes:
    """One compressed step of the compressed part, each tensor its own fedcomp payload (its own scale,
    norm or rotation), as the upload's ``selection = "tensor"`` sends it.

    Layout (little-endian): ``b"FCPT"``, uint32 count of payloads, then per non-empty tensor in model
    order uint32 length and the payload (its own wire header, 22 bytes for a 1-d sign payload, and body).

    Parameters
    ----------
    compress : callable
        ``compress(i, values)``: the payload of the ``i``-th non-empty tensor's float32 values.
    vec : numpy.ndarray
        float32, shape ``(sum(sizes),)``: the tensors' values flat, in model order.
    sizes : list of int
        Each tensor's number of entries, in model order (0: skipped).
    """
    out, off, count = [], 0, 0
    for n in sizes:
        if n:
            payload = compress(count, np.ascontiguousarray(vec[off: off + n]))
            out += [_COUNT.pack(len(payload)), payload]
            count += 1
        off += n
    return PER_TENSOR_MAGIC + _COUNT.pack(count) + b"".join(out)


def decode_step(payload: bytes | memoryview, sizes: list[int], dim: int | None = None) -> np.ndarray:
    """The float32 values, shape ``(sum(sizes),)``, of one compressed step: a fedcomp payload of the
    whole vector, a per-tensor step (`encode_per_tensor`) whose payloads must be exactly one
    per non-empty tensor of ``sizes``, each of that tensor's size, with nothing after the last, or a
    shared step (`fedcomp.download.shared_step`: a secure round's k summed values and its seed; ``dim``,
    the model's float entries, which it must name, and at most one segment per non-empty tensor).

    Raises
    ------
    fedcomp.compression.PayloadError
        A malformed step: wrong count, a length past the end, trailing bytes, or a payload that does
        not decode to its tensor's size, or (per tensor) to float32 values (a hostile server's bytes
        are refused, never guessed at).
    """
    n = sum(sizes)
    view = memoryview(payload).cast("B")
    if shared_step.is_shared_step(view):
        return shared_step.decode(view, n, dim=dim, max_segments=sum(1 for m in sizes if m))
    if bytes(view[:4]) != PER_TENSOR_MAGIC:
        return decompress(view, max_numel=max(n, 1), expected_shape=(n,)).numpy()
    want = [m for m in sizes if m]
    if len(view) < 8 or _COUNT.unpack_from(view, 4)[0] != len(want):
        got = _COUNT.unpack_from(view, 4)[0] if len(view) >= 8 else "no"
        raise PayloadError(f"per-tensor downstream step: {got} payloads for {len(want)} tensors")
    out, pos, off = np.zeros(n, np.float32), 8, 0
    for m in sizes:
        if m:
            if pos + 4 > len(view):
                raise PayloadError("per-tensor downstream step ends inside a length")
            (ln,) = _COUNT.unpack_from(view, pos)
            pos += 4
            if pos + ln > len(view):
                raise PayloadError(f"per-tensor downstream step: a payload of {ln} bytes runs past the end")
            part = decompress(view[pos: pos + ln], max_numel=m, expected_shape=(m,)).numpy()
            if part.dtype != np.float32:  # a float64 `none` payload: never sent per tensor, and would overflow
                raise PayloadError(f"per-tensor downstream step: a payload decodes to {part.dtype}, not float32")
            out[off: off + m] = part
            pos += ln
        off += m
    if pos != len(view):
        raise PayloadError(f"per-tensor downstream step: {len(view) - pos} bytes after the last payload")
    return out


def segments(model: FlatModel, keys: list[str]) -> list[tuple[int, int]]:
    """``[(flat offset, numel), ...]`` of float tensors ``keys`` in ``model.flat``."""
    return [(model.offsets[k], model.specs[k].numel) for k in keys]


def gather(model: FlatModel, keys: list[str]) -> np.ndarray:
    """The values of ``keys`` concatenated (a copy), shape ``(sum numel,)``, in ``model.flat``'s dtype
    (float32; float64 for a model with a float64 tensor)."""
    if keys == model.float_keys:
        return model.flat.copy()
    parts = [model.flat[o: o + n] for o, n in segments(model, keys)]
    return np.concatenate(parts) if parts else np.zeros(0, model.flat.dtype)


def scatter(model: FlatModel, keys: list[str], vec: np.ndarray) -> None:
    """Write ``vec`` (what `gather` returns) back into ``model.flat`` in place."""
    off = 0
    for o, n in segments(model, keys):
        model.flat[o: o + n] = vec[off: off + n]
        off += n


def round_to_dtypes(model: FlatModel, keys: list[str], vec: np.ndarray) -> np.ndarray:
    """Round ``vec`` (the float32 values of ``keys``) in place to each tensor's dtype (fp16, bf16),
    as a copy held in the model's own dtypes is; float32 tensors too when ``vec`` is float64 (a model
    with a float64 tensor); float64 tensors are left as they are.
    Values beyond fp16's range become +-inf here (the caller's cast check refuses them)."""
    off = 0
    for k in keys:
        spec = model.specs[k]
        n = spec.numel
        if spec.dtype == BF16:
            vec[off: off + n] = torch.from_numpy(vec[off: off + n].copy()).to(torch.bfloat16).float().numpy()
        elif spec.dtype == "float16":
            with np.errstate(over="ignore"):
                vec[off: off + n] = vec[off: off + n].astype(np.float16).astype(np.float32)
        elif spec.dtype == "float32" and vec.dtype == np.float64:  # a float64 model's flat: as the record stores it
            with np.errstate(over="ignore"):
                vec[off: off + n] = vec[off: off + n].astype(np.float32)
        off += n
    return vec



#: Bytes of a model copy's digest (`copy_digest`).
COPY_DIGEST_BYTES = 8


def copy_digest(model: FlatModel) -> bytes:
    """A digest of a model copy's float tensors, to compare a node's copy with the server's record of it.

    Parameters
    ----------
    model : FlatModel
        The copy; its float tensors (`FlatModel.flat`: model order, float32, or float64 for a model
        with a float64 tensor) are hashed, with ``-0.0`` read as ``+0.0`` (a sum that meets zero from
        either side gives the same copy). Integer and bool tensors travel exactly in every message and
        are not part of it.

    Returns
    -------
    bytes
        BLAKE2b with a ``COPY_DIGEST_BYTES``-byte (64-bit) digest (RFC 7693): a check against drift (two
        different copies agree with probability 2**-64), not a secret (the server knows the copy it sent)
        nor a proof (a node can report any digest; what it trains from is its own).
    """
    return digest_segments([model.flat], model.flat.dtype)


def digest_segments(segments: Iterable[np.ndarray], dtype: np.dtype) -> bytes:
    """`copy_digest` of the flat vector that ``segments`` (1-d arrays, in order) make up in ``dtype``,
    without building that vector (one segment's temporary at a time): the server digests its record of a
    node's copy from the pieces it keeps."""
    h = hashlib.blake2b(digest_size=COPY_DIGEST_BYTES)
    for seg in segments:
        h.update((np.asarray(seg).astype(dtype, copy=False) + dtype.type(0.0)).tobytes())  # -0.0 -> +0.0
    return h.digest()


__all__ = ["COPY_DIGEST_BYTES", "PER_TENSOR_MAGIC", "STAT_DELTA_PREFIX", "VAR_FLOOR", "apply_stat_delta",
           "chain_key", "copy_digest", "decode_step", "digest_segments", "encode_per_tensor", "gather",
           "is_batchnorm_stat", "is_running_var", "scatter", "segments", "round_to_dtypes", "stat_delta_key"]
