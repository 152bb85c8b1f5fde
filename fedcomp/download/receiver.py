"""Client side of server-to-client compression: rebuild the model a downstream message describes
and keep it (with its version) in ``context.state``.

Message forms (written by `fedcomp.download.sender`; the train config carries
``fedcomp-model-version`` whenever the server versions the model):

- dense: ordinary weights; kept as they are.
- payload / chain / diff: ``fedcomp-base-version`` names the copy this node must hold; the record
  holds the compressed payloads ``fedcomp.model``, ``fedcomp.model/1``, ... (applied in order to the
  compressed part: every float tensor not sent by name), the BatchNorm statistics as exact fp32
  payloads under their own names or (``batchnorm-stats = "auto"``) as their change since this
  node's copy under ``fedcomp.stat-delta/<name>`` (`fedcomp.download.layout.apply_stat_delta`),
  and the integer/bool tensors as exact payloads, under their own names.
- init: ``fedcomp-init-seed`` is set; the compressed part's tensors arrive as seeded-init rules
  (`fedcomp.download.seeded_init`: dtype, shape, bound), the others as plain arrays; payloads, if any,
  apply on top of that start.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedcomp.protocol.errors import CompositionError
from fedcomp.compression import PayloadError, decode_exact, decompress
from fedcomp.compression.wire import DEFAULT_MAX_NUMEL
from fedcomp.download.layout import (
    STAT_DELTA_PREFIX,
    apply_stat_delta,
    chain_key,
    copy_digest,
    decode_step,
    gather,
    is_batchnorm_stat,
    is_running_var,
    scatter,
    round_to_dtypes,
)
from fedcomp.protocol.messages import (
    BASE_VERSION,
    COPY_RECORD,
    MODEL_KEY,
    MODEL_META_KEY,
    MODEL_STATE_KEY,
    MODEL_VERSION,
    PAYLOAD_STYPE,
)
from fedcomp.download.seeded_init import INIT_SEED, INIT_STYPE, parse_rule, seeded_tensor
from fedcomp.statedict import FlatModel, is_float_dtype, numpy_dict
from fedcomp.statedict.arrays import numpy_view


#: Largest model version or seed a download may name: Flower's records hold int64.
MAX_VERSION = 2**63 - 1


def _version_keys(cfg) -> None:
    for key in (MODEL_VERSION, BASE_VERSION, INIT_SEED):
        v = cfg.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_VERSION:
            raise CompositionError(f"train config '{key}' must be an integer in [0, 2**63 - 1], got {v!r}")


def check_version(cfg, context: Context) -> None:
    """A downloaded model's version must be newer than the copy this node holds, or the held version
    itself in a message that builds on it (``fedcomp-base-version`` the held one: the node already holds
    the latest broadcast and trains or evaluates its copy; `rebuild` refuses steps in such a message) or
    that replaces it (dense weights, no base version: the server forgot the node, e.g. after a lost
    reply, and sends the current version whole; the copy becomes that model, as after a first contact).

    The server advances its broadcast version once per global model, so any other message whose
    ``fedcomp-model-version`` is not above the held one is a replay or a stale message. A first
    contact (``fedcomp-init-seed``) is the exception: it replaces the copy whatever it held, and a
    server that started over (its versions from 1 again) sends one to every node; a replayed old one
    cannot be folded as current (the server counts only replies to the messages of the round).

    Raises
    ------
    PayloadError
        ``fedcomp-model-version`` below the held copy's version, or equal to it in a message that does
        not build on the held version (the message names both).
    """
    _check_held_version(cfg, context.state)


def _check_held_version(cfg, state: RecordDict) -> None:
    """`check_version` against the copy kept in ``state``."""
    if MODEL_META_KEY not in state or INIT_SEED in cfg:
        return
    held, new = int(state[MODEL_META_KEY]["version"]), int(cfg[MODEL_VERSION])
    if new < held or (new == held and cfg.get(BASE_VERSION, 0) not in (0, held)):
        raise PayloadError(f"train config '{MODEL_VERSION}' = {new} is not newer than the model version this node "
                           f"holds ({held}): a replayed or stale download; refused before training, the held copy is "
                           "kept")


def check_download(rec: ArrayRecord) -> None:
    """The checks every model a message delivers passes before the app sees it and before it becomes
    this node's copy, whatever its form (dense weights, a first contact, payloads on the held copy; train
    or evaluate): every float tensor finite in its dtype, every BatchNorm running variance >= 0.

    Raises
    ------
    PayloadError
        An array that does not read as a tensor, a float tensor with NaN or Inf, or a running variance
        with a negative entry; the message names the tensor.
    """
    for k, a in rec.items():
        try:
            values = numpy_view(a)
        except (TypeError, ValueError) as err:
            raise PayloadError(f"downloaded model: '{k}' is not a readable tensor: {err}") from None
        if values.dtype.kind != "f" or not values.size:
            continue
        finite = np.isfinite(values)
        if not finite.all():
            raise PayloadError(f"downloaded model: '{k}' holds {int(values.size - finite.sum())} non-finite values "
                               "(NaN or Inf); refused before training, the held copy is kept")
        if is_running_var(k) and float(values.min()) < 0:
            raise PayloadError(f"downloaded model: '{k}' is a running variance with negative entries (min "
                               f"{float(values.min()):g}); refused before training, the held copy is kept")


def _parts(rec: ArrayRecord) -> list[bytes]:
    """The compressed payloads in application order.

    Raises
    ------
    PayloadError
        A payload key out of sequence, or a payload key that is not a payload.
    """
    n = 0
    while chain_key(n) in rec:
        n += 1
    stray = [k for k in rec.keys() if (k == MODEL_KEY or k.startswith(MODEL_KEY + "/"))
             and k not in {chain_key(i) for i in range(n)}]
    if stray:
        raise PayloadError(f"downstream payload keys out of sequence: {stray[:5]}")
    out = []
    for i in range(n):
        a = rec[chain_key(i)]
        if a.stype != PAYLOAD_STYPE:
            raise PayloadError(f"'{chain_key(i)}' is not a fedcomp payload (stype {a.stype!r})")
        out.append(bytes(a.data))
    return out


def _init_base(rec: ArrayRecord, seed: int, part_keys: set[str]) -> tuple[FlatModel, list[str]]:
    """The seeded start: (model, names of the compressed part).

    Raises
    ------
    PayloadError
        A seeded-init rule that is not 8 or 16 bytes, a bound or center outside float32's range
        (or non-finite), a non-float or unknown dtype, a negative dimension, or more elements than a
        payload may claim; a plain array that does not decode (naming the tensor).
    """
    values, dtypes, lossy, total = {}, {}, [], 0
    for k, a in rec.items():
        if k in part_keys:
            continue
        if a.stype == INIT_STYPE:
            try:
                is_float = bool(a.dtype) and is_float_dtype(a.dtype)
            except TypeError:  # a dtype fedcomp does not handle (float8, float128, complex, ...)
                is_float = False
            if not is_float:
                raise PayloadError(f"seeded-init rule of '{k}' is malformed (dtype {a.dtype!r}, {len(a.data)} bytes)")
            try:
                bound, center = parse_rule(k, bytes(a.data))
            except ValueError as err:
                raise PayloadError(str(err)) from None
            shape = tuple(int(d) for d in a.shape)
            if any(d < 0 for d in shape):
                raise PayloadError(f"seeded-init rule of '{k}' has a negative dimension: shape {shape}")
            total += math.prod(shape)  # Python ints: no wrap-around past int64
            if total > DEFAULT_MAX_NUMEL:
                raise PayloadError(f"seeded-init rules claim more than {DEFAULT_MAX_NUMEL} elements (at '{k}')")
            values[k], dtypes[k] = seeded_tensor(k, shape, bound, seed, center), a.dtype
            lossy.append(k)
        else:
            try:
                v, d = numpy_dict(ArrayRecord({k: a}))
                FlatModel(v, d)  # a dtype fedcomp handles
            except (TypeError, ValueError) as err:
                raise PayloadError(f"first-contact array '{k}' is malformed: {err}") from None
            values[k], dtypes[k] = v[k], d[k]
    try:
        model = FlatModel(values, dtypes)
    except (TypeError, ValueError) as err:
        raise PayloadError(f"seeded start: {err}") from None
    vec = round_to_dtypes(model, lossy, gather(model, lossy))
    scatter(model, lossy, vec)
    return model, lossy


@contextmanager
def _naming(key: str) -> Iterator[None]:
    """Re-raise a [`PayloadError`][fedcomp.compression.PayloadError] from decoding the array ``key`` with the key in
    front."""
    try:
        yield
    except PayloadError as err:
        raise PayloadError(f"'{key}': {err}") from None


def _held_base(rec: ArrayRecord, state: RecordDict, cfg, part_keys: set[str]) -> tuple[FlatModel, list[str]]:
    """The kept copy with the exactly sent tensors replaced: (model, names of the compressed part).

    Raises
    ------
    CompositionError
        No copy kept, or a copy of another version.
    PayloadError
        A tensor sent by name that the model does not have, a malformed exact payload or
        statistic change (the message names the array key).
    """
    if MODEL_STATE_KEY not in state:
        raise CompositionError("received a compressed model but this node keeps no model copy (new node?)")
    held = int(state[MODEL_META_KEY]["version"])
    if held != cfg.get(BASE_VERSION):
        raise CompositionError(f"this node holds model version {held}, the payload applies to {cfg.get(BASE_VERSION)}")
    base = FlatModel.from_record(state[MODEL_STATE_KEY])
    changes = {k[len(STAT_DELTA_PREFIX):]: k for k in rec.keys() if k.startswith(STAT_DELTA_PREFIX)}
    named = [k for k in rec.keys() if k not in part_keys and k not in changes.values()]
    unknown = sorted(set(named) - set(base.keys)) + sorted(
        k for k, rk in changes.items() if k not in base.float_keys or not is_batchnorm_stat(k) or k in named)
    if unknown:
        raise PayloadError(f"downstream payload carries unknown keys {unknown[:5]}")
    for k, rk in changes.items():  # a BatchNorm statistic's change since this node's copy
        if rec[rk].stype != PAYLOAD_STYPE:
            raise PayloadError(f"'{rk}' is not a fedcomp payload (stype {rec[rk].stype!r})")
        n = base.specs[k].numel
        with _naming(rk):
            apply_stat_delta(base, k, decompress(bytes(rec[rk].data), max_numel=max(n, 1),
                                                 expected_shape=(n,)).numpy())
    for k in named:
        spec = base.specs[k]
        with _naming(k):
            if spec.is_float:  # exempt (BatchNorm statistics): the exact fp32 values
                base.float_view(k)[...] = decompress(rec[k].data, max_numel=max(spec.numel, 1),
                                                     expected_shape=spec.shape).numpy()
            else:
                base.exact[k] = decode_exact(rec[k].data, spec.shape, spec.dtype)
    named += list(changes)
    return base, [k for k in base.float_keys if k not in named]


def rebuild(msg: Message, context: Context, arr_key: str, rec: ArrayRecord, cfg) -> ArrayRecord:
    """Rebuild the model of a downstream message and keep it in ``context.state`` (`rebuild_model`); the
    message's ArrayRecord ``arr_key`` becomes the rebuilt dense weights."""
    out, rebuilt = rebuild_model(context.state, rec, cfg)
    if rebuilt:
        msg.content[arr_key] = out
    return out


def rebuild_model(state: RecordDict, rec: ArrayRecord, cfg) -> tuple[ArrayRecord, bool]:
    """Rebuild the model a download describes and keep it, with its version, in ``state`` as this node's copy.

    Parameters
    ----------
    state : RecordDict
        Where the node keeps its copy (``context.state``).
    rec : ArrayRecord
        The received record.
    cfg : mapping
        The train config.

    Returns
    -------
    (ArrayRecord, bool)
        Dense weights, every tensor in its dtype and shape; whether they were rebuilt (False: ``rec``
        itself, dense weights as sent).

    Raises
    ------
    CompositionError
        A payload arrives but this node holds no copy, or a copy of another version.
    PayloadError
        A malformed payload or seeded-init rule, unknown keys, another shape or dtype; rules or
        payloads without ``fedcomp-model-version``; a BatchNorm statistic change
        (``fedcomp.stat-delta/<name>``) in an init or dense message (no held copy to apply it to); a
        model version not above the held one (`check_version`); a model, in any form, that
        fails `check_download` (not finite in its dtypes, a negative running variance). The held
        copy and its version are kept.
    """
    if MODEL_VERSION not in cfg:
        ours = [k for k, a in rec.items() if a.stype in (INIT_STYPE, PAYLOAD_STYPE)]
        if ours:  # not dense weights: the version keys are missing
            raise PayloadError(f"downstream message without train config '{MODEL_VERSION}' carries seeded-init "
                               f"rules or payloads {ours[:5]}")
        check_download(rec)
        return rec, False
    _version_keys(cfg)
    _check_held_version(cfg, state)
    parts = _parts(rec)
    part_keys = {chain_key(i) for i in range(len(parts))}
    on_held = INIT_SEED not in cfg and (parts or cfg.get(BASE_VERSION, 0) > 0)  # steps on the held copy, or none
    if on_held and not parts and cfg.get(BASE_VERSION) != cfg[MODEL_VERSION]:
        raise PayloadError(f"downstream message names base version {cfg.get(BASE_VERSION)} and version "
                           f"{cfg[MODEL_VERSION]} but carries no step between them")
    if parts and cfg.get(BASE_VERSION) == cfg[MODEL_VERSION]:
        raise PayloadError(f"downstream message carries steps but its version ({cfg[MODEL_VERSION]}) is its base's")
    changes = sorted(k for k in rec.keys() if k.startswith(STAT_DELTA_PREFIX))
    if changes and not on_held:  # a change needs the copy the message builds on
        raise PayloadError(f"downstream message carries BatchNorm statistic changes {changes[:5]} but names no "
                           f"held copy to apply them to ({'init' if INIT_SEED in cfg else 'dense'} message)")
    if INIT_SEED in cfg:
        base, lossy = _init_base(rec, int(cfg[INIT_SEED]), part_keys)
    elif on_held:
        base, lossy = _held_base(rec, state, cfg, part_keys)
    else:
        base = None
    if base is not None:
        sizes = [base.specs[k].numel for k in lossy]
        dim = sum(base.specs[k].numel for k in base.float_keys)
        vec = gather(base, lossy)
        for p in parts:
            with np.errstate(over="ignore"):  # a sum past the dtype's range: check_download names the tensor
                vec = round_to_dtypes(base, lossy, vec + decode_step(p, sizes, dim))
        scatter(base, lossy, vec)
        rec = base.record(check=False)  # check_download names a tensor that is not finite in its dtype
    check_download(rec)  # every form: the held copy is replaced only by a model that passes
    state[MODEL_STATE_KEY] = ArrayRecord({k: Array(dtype=a.dtype, shape=tuple(a.shape), stype=a.stype,
                                                   data=bytes(a.data)) for k, a in rec.items()})
    state[MODEL_META_KEY] = MetricRecord({"version": int(cfg[MODEL_VERSION])})
    return rec, base is not None


def held_copy_digest(state: RecordDict) -> bytes | None:
    """The digest of the model copy kept in ``state`` (`fedcomp.download.layout.copy_digest`; None: none kept)."""
    if MODEL_STATE_KEY not in state:
        return None
    return copy_digest(FlatModel.from_record(state[MODEL_STATE_KEY]))


def report_copy(reply: Message, context: Context) -> None:
    """Add the digest of the model copy this node holds (`held_copy_digest`) to ``reply`` as the
    ConfigRecord ``fedcomp.copy``, so that the server can compare it with its record of what this node
    holds and send a first contact when the two differ. Nothing without a copy (a node that was sent
    dense weights without a version) or on an error reply."""
    digest = None if reply.has_error() else held_copy_digest(context.state)
    if digest is not None:
        reply.content[COPY_RECORD] = ConfigRecord({"digest": digest})


__all__ = ["check_download", "check_version", "held_copy_digest", "rebuild", "rebuild_model", "report_copy"]
