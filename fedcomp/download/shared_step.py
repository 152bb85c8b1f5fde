"""A download step that is the round's shared-projection sum: k values and a seed instead of the model.

Under secure aggregation with shared-seed random-k (`fedcomp.secagg`) every client of a round encodes
its update as ``(R x)[positions]``, with the positions and the rotation R drawn from the round's seed,
and the server learns only the weighted mean m of those k values. With a weighted-mean server step
the global model then moves by ``factor * R^T scatter(m)``: a node that holds the previous broadcast
version needs m, the seed and the factor, not the model. SecAgg+'s quantization puts m on a grid
(at most ``n * Q + 1`` distinct values for n clients and Q levels), so m travels exactly as a table
of its distinct values and one index per value: ``ceil(log2(distinct))`` bits each, about as many as
one client's masked vector.

`SharedStep` holds a round's (projection, m, factor); `SharedStep.payload` encodes it for the
float tensors the download compresses (their segments of the flat float vector), and `decode`
rebuilds the step's float32 vector, the same on the server and on every node (one code path; the
Hadamard transform's additions and the scalings are exactly rounded, so the result does not depend on
the machine). The sender (`fedcomp.download.sender.Downstream`) uses it only when the step it
describes lands within `SHARED_STEP_TOLERANCE` of the global model (an inner strategy with server
momentum moves the model otherwise: the codec's step then); what it leaves out stays in the
server's error feedback ``G - B``.

Wire form (little-endian): `MAGIC`; ``dim, k, seed`` (u64), ``density, factor`` (f64), ``rotate``
(u8), the segment count (u32) and each segment's ``offset, length`` (u64); the table's size (u16,
1..`MAX_TABLE`) and its values (f64); the indices packed at the table's width
(`fedcomp.compression.bits.pack_uint`). Nothing may follow.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

from fedcomp.compression import PayloadError
from fedcomp.compression.bits import nbytes_for_bits, pack_uint, unpack_uint
from fedcomp.compression.shared_projection import SharedProjection
from fedcomp.compression.sparse import k_for

#: First bytes of a shared step (a fedcomp codec payload and a per-tensor step start otherwise).
MAGIC = b"FCSS"
#: Most distinct values of m sent as a table: a sum of quantized values has few; noise gives k.
MAX_TABLE = 256
#: The shared step is sent when it leaves at most this fraction of the change (L2) the codec would send.
SHARED_STEP_TOLERANCE = 0.01
_HEAD = struct.Struct("<QQQddBI")
_SEGMENT = struct.Struct("<QQ")
_TABLE = struct.Struct("<H")


def _width(n: int) -> int:
    return max(1, math.ceil(math.log2(n))) if n > 1 else 1


@dataclass(frozen=True)
class SharedStep:
    """One round's update as its shared-projection sum.

    Parameters
    ----------
    projection : SharedProjection
        The round's positions and rotation (its ``dim`` is the model's float entries, model order).
    values : np.ndarray
        m, float64 shape ``(k,)``: the decoded secure mean at the positions (before ``factor``).
    factor : float
        The server's step on ``R^T scatter(m)`` (its learning rate), finite and > 0.
    """

    projection: SharedProjection
    values: np.ndarray
    factor: float

    def payload(self, segments: list[tuple[int, int]]) -> bytes | None:
        """The step's bytes for the float entries ``segments`` (``(offset, length)`` in the flat float
        vector of ``projection.dim`` entries, ascending); None when m has more than `MAX_TABLE` distinct
        values (not on a grid: noise was added), is not finite, or does not match the projection."""
        values = np.asarray(self.values, dtype=np.float64).reshape(-1)
        proj = self.projection
        if values.size != proj.k or not np.isfinite(values).all() or not math.isfinite(self.factor) \
                or self.factor <= 0:
            return None
        table, index = np.unique(values, return_inverse=True)
        if table.size > MAX_TABLE:
            return None
        out = [MAGIC, _HEAD.pack(proj.dim, proj.k, proj.seed, proj.density, float(self.factor), int(proj.rotate),
                                 len(segments))]
        out += [_SEGMENT.pack(int(o), int(n)) for o, n in segments]
        out += [_TABLE.pack(table.size), table.astype("<f8").tobytes(),
                pack_uint(index.reshape(-1).astype(np.uint64), _width(table.size))]
        return b"".join(out)


def is_shared_step(view: memoryview) -> bool:
    """Whether a download step's bytes are a shared step (they start with `MAGIC`)."""
    return bytes(view[:4]) == MAGIC


def decode(view: memoryview, n: int, dim: int | None = None, max_segments: int | None = None) -> np.ndarray:
    """The float32 step, shape ``(n,)``, that a shared step's bytes describe.

    ``n``: the entries the download compresses; the step's segments must add up to it, none empty.
    ``dim``: the model's float entries, which the step's projection must cover exactly (None: at most
    ``4 * n + 4096``, the memory a hostile step could ask for). ``max_segments``: at most this many
    segments (the download's non-empty tensors; None: ``n``).

    Raises
    ------
    fedcomp.compression.PayloadError
        A malformed step: truncated or trailing bytes, k not the projection's, segments out of order or
        past ``dim`` or not adding up to ``n``, a table that is empty, too large or not finite, an index
        past the table, a factor that is not finite and > 0, or a step that is not finite in float32.
    """
    view = memoryview(view).cast("B")
    pos = len(MAGIC)
    if len(view) < pos + _HEAD.size:
        raise PayloadError("shared download step: truncated header")
    want_dim = dim
    dim, k, seed, density, factor, rotate, nseg = _HEAD.unpack_from(view, pos)
    pos += _HEAD.size
    if dim != want_dim if want_dim is not None else not 1 <= dim <= 4 * n + 4096:
        raise PayloadError(f"shared download step: dim {dim} for a model of {want_dim} float entries, {n} sent")
    if not (0 < density <= 1) or k != k_for(density, dim) or rotate > 1:
        raise PayloadError(f"shared download step: k = {k}, density {density}, rotate {rotate} do not agree with "
                           f"dim {dim}")
    if not (math.isfinite(factor) and factor > 0):
        raise PayloadError(f"shared download step: factor {factor} is not finite and > 0")
    most = n if max_segments is None else max_segments
    if nseg > most or len(view) < pos + nseg * _SEGMENT.size + _TABLE.size:
        raise PayloadError(f"shared download step: {nseg} segments, truncated")
    segments, end = [], 0
    for _ in range(nseg):
        off, length = _SEGMENT.unpack_from(view, pos)
        pos += _SEGMENT.size
        if off < end or off + length > dim or length == 0:
            raise PayloadError(f"shared download step: segment ({off}, {length}) empty, out of order or past dim "
                               f"{dim}")
        segments.append((off, length))
        end = off + length
    if sum(length for _, length in segments) != n:
        raise PayloadError(f"shared download step: segments cover {sum(s[1] for s in segments)} entries, not {n}")
    (size,) = _TABLE.unpack_from(view, pos)
    pos += _TABLE.size
    if not 1 <= size <= MAX_TABLE or len(view) < pos + 8 * size:
        raise PayloadError(f"shared download step: a table of {size} values, truncated or outside 1..{MAX_TABLE}")
    table = np.frombuffer(view[pos: pos + 8 * size], dtype="<f8").astype(np.float64)
    pos += 8 * size
    if not np.isfinite(table).all():
        raise PayloadError("shared download step: its table is not finite")
    width = _width(size)
    if len(view) - pos != nbytes_for_bits(k * width):
        raise PayloadError(f"shared download step: {len(view) - pos} bytes of indices for {k} at {width} bits")
    index = unpack_uint(view[pos:], k, width, "shared download step").astype(np.int64)
    if index.size and int(index.max()) >= size:
        raise PayloadError(f"shared download step: an index past its table of {size}")
    proj = SharedProjection(int(dim), float(density), int(seed), bool(rotate))
    full = proj.decode(table[index]) * factor
    out = np.concatenate([full[o: o + length] for o, length in segments]) if segments else np.zeros(0)
    with np.errstate(over="ignore"):  # past float32's range: refused just below
        step = out.astype(np.float32)
    if not np.isfinite(step).all():
        raise PayloadError("shared download step: the step is not finite in float32")
    return step


__all__ = ["MAGIC", "MAX_TABLE", "SHARED_STEP_TOLERANCE", "SharedStep", "decode", "is_shared_step"]
