"""Decoding one client's compressed reply (Flower types in, numpy out), validated before anything is folded.

A reply's ArrayRecord holds fedcomp payloads: one per float tensor sent on its own, optionally one
under ``MODEL_KEY`` for every other float tensor (flattened and concatenated in model order), and
exact payloads of the integer/bool tensors (absent under local DP). `decode_reply` turns it
into a `DecodedUpdate` over the global model's flat float vector: sparse parts as
``(flat positions, values)`` (O(k), never densified), dense parts as float32 segments, except the
dense payloads of large single tensors, which are validated and then kept as their bytes
(`DeferredPart`, decoded again as they are folded: a reply never holds its dense update whole).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.app import ArrayRecord, Message

from fedcomp.compression import PayloadError, codec_name, decode_exact, decompress, decompress_sparse
from fedcomp.protocol.messages import MODEL_KEY, PAYLOAD_STYPE
from fedcomp.statedict import FlatModel, copy_array, numpy_dict
from fedcomp.strategies.admission import check_weight
from fedcomp.strategies.failures import printable
from fedcomp.strategies.round_metrics import bounded_metrics

#: Longest client-supplied name (key, stype, dtype) quoted in a refusal.
MAX_NAME_CHARS = 80

#: Dense payloads of one tensor with at least this many entries are kept as their bytes once validated
#: and decoded again when folded (`DeferredPart`), so a reply never holds its dense float32 update
#: whole (sign: 1 bit per entry held instead of 32); smaller ones are kept decoded.
DEFER_MIN_NUMEL = 1 << 16


@dataclass(frozen=True)
class DeferredPart:
    """A validated dense payload kept as its bytes: `parts` decodes it again (the same values,
    bit for bit: decoding is deterministic).

    Attributes
    ----------
    data : bytes
        The payload (a reference to the reply's bytes, not a copy).
    shape : tuple of int
        The shape it was validated against.
    segments : list of (int, int, int)
        ``(local start, flat start, length)`` of the parts it covers.
    """

    data: bytes
    shape: tuple
    segments: list

    def parts(self, scratch: np.ndarray | None = None):
        """``(flat start, float32 values)`` per segment, decoded now: into ``scratch`` (float32, at
        least the payload's entries; the values are valid until the next decode into it) when
        given, which spares a fresh n-sized array per payload (``decompress(out=...)``)."""
        numel = sum(n for _, _, n in self.segments)
        flat = None
        if scratch is not None and scratch.size >= numel and scratch.dtype == np.float32:
            try:
                flat = decompress(self.data, max_numel=max(numel, 1), expected_shape=self.shape,
                                  out=torch.from_numpy(scratch[:numel])).numpy()
            except PayloadError:
                raise
            except ValueError:  # a payload that decodes to float64 (`none` of a float64 tensor)
                flat = None
        if flat is None:
            flat = decompress(self.data, max_numel=max(numel, 1), expected_shape=self.shape).numpy().reshape(-1)
        for local, start, n in self.segments:
            yield start, flat[local: local + n]

    @property
    def numel(self) -> int:
        """Entries of the payload (the sum of its segments)."""
        return sum(n for _, _, n in self.segments)


@dataclass
class DecodedUpdate:
    """One client's decoded update.

    Attributes
    ----------
    sparse : list of (np.ndarray, np.ndarray)
        ``(positions, values)``: int64 positions into the global flat float vector (unique within a
        part; parts cover disjoint tensors) and their float32 values.
    dense : list of (int, np.ndarray)
        ``(flat start, values)``: float32 segments of the update (float64 for ``none`` payloads of
        float64 tensors).
    deferred : list of DeferredPart
        Validated dense payloads of single large tensors, decoded again when read
        (`DEFER_MIN_NUMEL`); `dense_parts` yields them after ``dense``.
    exact : dict of str to np.ndarray
        Integer/bool tensors' new values, in the model's dtype and shape (only those sent).
    upload_bytes : int
        Payload bytes of the reply.
    codecs : dict of str to int
        Payload bytes per codec name.
    """

    sparse: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    dense: list[tuple[int, np.ndarray]] = field(default_factory=list)
    exact: dict[str, np.ndarray] = field(default_factory=dict)
    upload_bytes: int = 0
    codecs: dict[str, int] = field(default_factory=dict)
    deferred: list[DeferredPart] = field(default_factory=list)

    def dense_parts(self, scratch: np.ndarray | None = None):
        """Every dense ``(flat start, values)`` segment: ``dense``, then the deferred payloads' (each
        decoded as it is reached, so at most one tensor's values exist at a time; into ``scratch``
        when given, see `DeferredPart.parts`: consume each part before the next)."""
        yield from self.dense
        for part in self.deferred:
            yield from part.parts(scratch)

    def sq_norm(self) -> float:
        """Squared L2 norm of the float update (float64 accumulation; integer tensors excluded).

        The dense segments' squares are added in the order of their flat start, so the result does
        not depend on which payloads were deferred (a deferred one is decoded last)."""
        total = sum(float(np.dot(v.astype(np.float64), v.astype(np.float64))) for _, v in self.sparse)
        dense = sorted((start, float(np.dot(v, v.astype(np.float64)))) for start, v in self.dense_parts())
        return total + sum(sq for _, sq in dense)

    def to_flat(self, num_float: int, dtype=np.float32) -> np.ndarray:
        """The float update as one dense vector of ``num_float`` entries (dense path only); ``dtype``
        float32, or float64 for a model with float64 tensors (``FlatModel.flat.dtype``)."""
        out = np.zeros(num_float, dtype=dtype)
        for pos, vals in self.sparse:
            out[pos] = vals
        for start, vals in self.dense_parts():
            out[start: start + vals.size] = vals
        return out


def _payload_bytes(arr, key: str) -> bytes:
    if arr.stype != PAYLOAD_STYPE:
        raise PayloadError(
            f"'{printable(key, MAX_NAME_CHARS)}' is a dense '{printable(arr.stype, MAX_NAME_CHARS)}' array, not a "
            "fedcomp payload: add compression_mod as the FIRST mod of the ClientApp (mods=[compression_mod, ...])"
        )
    return arr.data


def _check_finite(model: FlatModel, flat_pos: np.ndarray | None, start: int, vals: np.ndarray) -> None:
    """Global + update must be finite in each tensor's dtype at the entries the update touches
    (sparse: ``flat_pos``; dense: the segment from ``start``)."""
    if flat_pos is not None:
        g, limit = model.flat[flat_pos], model.limits_at(flat_pos)
    else:
        g, limit = model.flat[start: start + vals.size], model.limits_at(np.array([start]))
    with np.errstate(over="ignore", invalid="ignore"):
        bad = ~(np.abs(g + vals) <= limit)
    if bool(bad.any()):
        first = int(np.argmax(bad))
        key = model.key_at(int(flat_pos[first]) if flat_pos is not None else start)
        raise PayloadError(f"'{key}': global + update is not finite in the model's dtype {model.specs[key].dtype}")


#: Codec name under which dense (uncompressed) replies are counted: metric ``upload-bytes-dense``.
DENSE_NAME = "dense"


def is_dense_reply(record: ArrayRecord) -> bool:
    """True if no Array of ``record`` is a fedcomp payload (a client without ``compression_mod``)."""
    return len(record) > 0 and all(a.stype != PAYLOAD_STYPE for a in record.values())


def decode_dense_reply(record: ArrayRecord, model: FlatModel) -> DecodedUpdate:
    """A dense reply (plain weights, as a client without ``compression_mod`` sends them) as an
    uncompressed update ``weights - global`` (so that a server upgraded before its
    clients keeps counting them).

    Validated like any payload: exactly the model's keys, each Array numpy-serialised (or bf16 as
    `fedcomp.statedict.to_record` writes it) with the model's shape and dtype, float values
    finite in the tensor's dtype. The difference is taken in float64 and stored in the model's
    flat dtype (float32, or float64 for float64 models). Bytes are the Arrays' real bytes, counted
    under `DENSE_NAME`.

    Raises
    ------
    PayloadError
        Other keys, another shape or dtype, an Array that is not numpy data, or a non-finite value.
    """
    if set(record.keys()) != set(model.keys):
        missing = sorted(set(model.keys) - set(record.keys()))
        extra = sorted(set(record.keys()) - set(model.keys))
        raise PayloadError(f"dense reply keys differ from the model's: missing {missing[:5]}, unexpected {extra[:5]}")
    out = DecodedUpdate()
    for key in model.keys:
        arr, spec = record[key], model.specs[key]
        try:
            values, dtypes = numpy_dict(ArrayRecord({key: arr}))
        except Exception as exc:  # noqa: BLE001 - any deserialisation problem is a bad reply
            raise PayloadError(f"dense reply '{key}' is not numpy data ({type(exc).__name__}: {exc})") from None
        v, dt = values[key], dtypes[key]
        if tuple(v.shape) != spec.shape or dt != spec.dtype:
            raise PayloadError(f"dense reply '{key}' is {printable(dt, MAX_NAME_CHARS)} {tuple(v.shape)}, the model's "
                               f"tensor is {spec.dtype} {spec.shape}")
        if spec.is_float:
            start = model.offsets[key]
            with np.errstate(over="ignore", invalid="ignore"):
                d = (np.asarray(v, np.float64).reshape(-1) - model.float_view(key).reshape(-1)).astype(model.flat.dtype)
            if d.size and not np.isfinite(d).all():
                raise PayloadError(f"'{key}': dense reply holds values that are not finite in {model.flat.dtype}")
            _check_finite(model, None, start, d)
            out.dense.append((start, d))
        else:
            out.exact[key] = copy_array(v)
        out.upload_bytes += len(arr.data)
    out.codecs[DENSE_NAME] = out.upload_bytes
    return out


def decode_reply(record: ArrayRecord, model: FlatModel) -> DecodedUpdate:
    """Decode and validate a client's payload record against the global model it was sent.

    A dense reply (no fedcomp payload at all) is decoded by `decode_dense_reply` instead
    (the caller decides whether to accept it: ``CompressedStrategy(require_compression=...)``).

    Parameters
    ----------
    record : ArrayRecord
        The reply's ArrayRecord (keys in any order).
    model : FlatModel
        The global model sent this round.

    Returns
    -------
    DecodedUpdate

    Raises
    ------
    PayloadError
        A float tensor missing or covered twice, an unknown key, an Array that is not a fedcomp
        payload (with a hint to add ``compression_mod``), a payload larger in elements or of another
        shape than its tensor, an exact payload for a float tensor or a codec payload for an integer
        one, any malformed payload, or a result that is not finite in the tensor's dtype.
    """
    if is_dense_reply(record):
        return decode_dense_reply(record, model)
    keys = list(record.keys())
    known = set(model.keys)
    unknown = sorted(k for k in keys if k != MODEL_KEY and k not in known)
    individual = [k for k in model.float_keys if k in record]
    covered = [k for k in model.float_keys if k not in record] if MODEL_KEY in record else []
    missing = sorted(set(model.float_keys) - set(individual) - set(covered))
    if unknown or missing:
        raise PayloadError(f"reply keys differ from the model's: missing {missing[:5]}, unexpected {unknown[:5]}")
    if MODEL_KEY in record and not covered:
        raise PayloadError(f"reply has a '{MODEL_KEY}' payload but every float tensor was also sent on its own")
    out = DecodedUpdate()

    def count(data: bytes) -> None:
        name = codec_name(data)
        out.codecs[name] = out.codecs.get(name, 0) + len(data)

    for key in individual:
        spec, data = model.specs[key], _payload_bytes(record[key], key)
        start = model.offsets[key]
        _decode_unit(model, data, spec.shape, [(0, start, spec.numel)], out, defer=spec.numel >= DEFER_MIN_NUMEL)
        count(data)
    if covered:
        data = _payload_bytes(record[MODEL_KEY], MODEL_KEY)
        total = sum(model.specs[k].numel for k in covered)
        _decode_unit(model, data, (total,), model.segments(covered), out)
        count(data)
    for key in model.exact_keys:
        if key in record:
            data = _payload_bytes(record[key], key)
            out.exact[key] = decode_exact(data, model.specs[key].shape, model.specs[key].dtype)
            count(data)
    out.upload_bytes = sum(out.codecs.values())
    return out


def _decode_unit(model: FlatModel, data: bytes, shape: tuple, segments: list[tuple[int, int, int]],
                 out: DecodedUpdate, defer: bool = False) -> None:
    """Decode one payload covering ``segments`` (local start, flat start, length) of the flat vector;
    ``defer``: a dense one is validated, then kept as its bytes (`DeferredPart`)."""
    numel = sum(n for _, _, n in segments)
    sparse = decompress_sparse(data, max_numel=max(numel, 1), expected_shape=shape)
    if sparse is not None:
        pos, vals = sparse
        local = np.array([s[0] for s in segments], dtype=np.int64)
        shift = np.array([s[1] - s[0] for s in segments], dtype=np.int64)
        if len(segments) == 1 or bool((shift == shift[0]).all()):
            flat_pos = pos + shift[0]
        else:
            flat_pos = pos + shift[np.searchsorted(local, pos, side="right") - 1]
        _check_finite(model, flat_pos, 0, vals)
        out.sparse.append((flat_pos, vals))
        return
    flat = decompress(data, max_numel=max(numel, 1), expected_shape=shape).numpy().reshape(-1)
    for local, start, n in segments:
        seg = flat[local: local + n]
        _check_finite(model, None, start, seg)
        if not defer:
            out.dense.append((start, seg))
    if defer:
        out.deferred.append(DeferredPart(data, tuple(shape), list(segments)))


def decode_update(record: ArrayRecord, global_arrays: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict]:
    """Dense weights ``global + decoded delta`` of one reply (the legacy strategy's path).

    Parameters
    ----------
    record : ArrayRecord
        The reply's payload record.
    global_arrays : dict of str to np.ndarray
        The global weights this client was sent (keys in model order).

    Returns
    -------
    (weights, info)
        Dense weights under the global keys, each of the global dtype and shape (integer/bool
        tensors: the client's exact values, or the global ones if it sent none); and
        ``{"upload-bytes": int, "codecs": {codec name: bytes}}`` measured from the payloads.

    Raises
    ------
    PayloadError
        As `decode_reply`.
    """
    model = FlatModel.from_numpy(global_arrays)
    upd = decode_reply(record, model)
    rec = model.record(upd.to_flat(model.num_float, model.flat.dtype), upd.exact)
    weights = {k: rec[k].numpy() for k in model.keys}
    return weights, {"upload-bytes": upd.upload_bytes, "codecs": upd.codecs}


@dataclass
class TrainReply:
    """One client's train reply, decoded and validated (nothing folded yet).

    Attributes
    ----------
    update : DecodedUpdate
    weight : float
        The reply's weighting metric (``num-examples``), an integer in [1, max].
    metrics : dict
        Its finite scalar metrics (what the inner strategy averages and metrics.json stores).
    reported : dict
        Everything it reported except per-layer lists (read by `round_metrics.client_stats`).
    layers : dict
        ``layer-update-norm`` / ``layer-compression-error`` lists, where sent.
    decode_seconds : float
    """

    update: DecodedUpdate
    weight: float
    metrics: dict
    reported: dict
    layers: dict
    decode_seconds: float


def decode_train_reply(reply: Message, model: FlatModel, weight_key: str, max_weight: int,
                       refuse_dense: str = "", keep_exact: bool = True) -> TrainReply:
    """Decode one train reply of ``compression_mod`` (or a dense one) and validate its shape and weight.

    Parameters
    ----------
    refuse_dense : str
        Why a dense reply (no fedcomp payload) is refused ("": it is accepted).
    keep_exact : bool
        False: drop the reply's integer/bool tensors (local DP: the server keeps its own values).

    Raises
    ------
    PayloadError
        Not exactly one ArrayRecord and one MetricRecord, a weight that is not an integer in
        [1, ``max_weight``], a dense reply while ``refuse_dense`` says why not, or a payload
        `decode_reply` refuses.
    """
    recs = reply.content.array_records
    if len(recs) != 1:
        raise PayloadError(f"expected one ArrayRecord in the reply, found {len(recs)}")
    mrecs = reply.content.metric_records
    if len(mrecs) != 1:
        raise PayloadError(f"expected one MetricRecord in the reply, found {len(mrecs)}")
    reported = dict(next(iter(mrecs.values())))
    n = check_weight(reported.get(weight_key), weight_key, max_weight)
    t0 = time.perf_counter()
    record = next(iter(recs.values()))
    if refuse_dense and is_dense_reply(record):  # a client without compression_mod (mixed fleet)
        raise PayloadError(f"a dense reply (no fedcomp payload) is refused: {refuse_dense}; add compression_mod as "
                           "the FIRST mod of the ClientApp (mods=[compression_mod, ...])")
    update = decode_reply(record, model)
    if not keep_exact:
        update.exact = {}
    decode_seconds = time.perf_counter() - t0
    layers = {k: reported.pop(k) for k in ("layer-update-norm", "layer-compression-error") if k in reported}
    # Finite scalar metrics, bounded: the inner strategy averages them, metrics.json stores them.
    return TrainReply(update, n, bounded_metrics(reported), reported, layers, decode_seconds)


__all__ = ["DEFER_MIN_NUMEL", "DENSE_NAME", "DecodedUpdate", "DeferredPart", "TrainReply", "decode_dense_reply",
           "decode_reply", "decode_train_reply", "decode_update", "is_dense_reply"]
