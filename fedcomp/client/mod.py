"""``compression_mod``: the Flower client mod that turns trained weights into compressed updates.

One train message passes these stages, each a function below, in order: parse the request
(`request.TrainRequest`) -> rebuild a downstream-compressed model and check the model of
every download form (`fedcomp.download.receiver.rebuild`) -> let the app train -> check the reply (dense, clipped where
the server asked) -> compress with error feedback (`update.compress_update`, state from
`state`; a saturating fp16 residual warned once per node, `warn_saturation_once`) ->
write the payloads and metrics into the reply, with the digest of the model copy this node now holds
(`fedcomp.download.receiver.report_copy`).
"""

from __future__ import annotations

import logging
import time
import warnings
from logging import ERROR

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord
from flwr.common.logger import log
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

from fedcomp.download.legacy import copy_digest_metric, expand_legacy_message
from fedcomp.download.receiver import rebuild, report_copy
from fedcomp.client.request import TrainRequest, only_record
from fedcomp.client.secure_path import encoded_by_secure_mod
from fedcomp.client.state import keep_residuals, residuals_of, state_files
from fedcomp.client.update import CompositionError, compress_update, in_position_order
from fedcomp.protocol.device import clientapp_seconds, memory_report
from fedcomp.protocol.messages import (
    DEFAULT_DOWNLINK_MBPS,
    DEFAULT_UPLINK_MBPS,
    ESTIMATE_ROUND_METRIC,
    LAYER_REPORT_KEY,
    LEAN_DEFAULTS,
    MIN_LINK_MBPS,
    MODEL_VERSION,
    PAYLOAD_STYPE,
    SECAGG_SEED_KEY,
    payload_array,
)
from fedcomp.statedict import numpy_views

#: Link speeds (megabits per second) of a node that declares none.
DEFAULT_LINK_MBPS = {"uplink-mbps": DEFAULT_UPLINK_MBPS, "downlink-mbps": DEFAULT_DOWNLINK_MBPS}
#: Clients already warned about fp16 residual saturation (one warning each per process).
_SATURATION_WARNED: set = set()


def compression_mod(msg: Message, context: Context, call_next) -> Message:
    """Flower client mod: reply with compressed updates instead of dense weights.

    Place it first (outermost) in ``ClientApp(mods=[compression_mod, ...])``. On a
    ``train`` message it reads the codec from the train ConfigRecord (keys of
    `fedcomp.config.CodecConfig`; node config keys of the same names override
    them, e.g. a slow device forcing ``compressor = "sign"``), lets the app train, then
    replaces the reply's ArrayRecord by one fedcomp payload per parameter of
    ``delta = returned - received`` (+ error-feedback residual, kept in
    ``context.state`` across rounds). Adds metrics ``upload-bytes`` (payload bytes),
    ``dense-bytes`` (fp32 cost), ``download-bytes`` (bytes of the received arrays),
    ``compression-error``, ``residual-norm``, ``residual-bytes`` (memory of the residual),
    ``compress-seconds``, ``clientapp-seconds`` (`fedcomp.protocol.device.clientapp_seconds`: the
    age of a per-message ``flwr-clientapp`` process, else 0) and the node's ``uplink-mbps``/``downlink-mbps`` (node
    config, else run config; defaults 1 and 10) to the reply's MetricRecord.

    Only a train message with exactly one ArrayRecord is ours (`is_ours`); any other message
    goes to the next mod untouched, and its reply comes back untouched: other message types, a
    train message without weights or with several ArrayRecords, a Flower SecAgg+ protocol message
    (a ``secaggplus_configs`` record), and a train message whose config carries fedcomp's SecAgg+
    shared seed (``fedcomp-secagg-seed``: under ``secagg = true`` the update is encoded by
    ``fedcomp.secagg.shared_randomk_mod``) -- only inside that mod's own call
    (`fedcomp.client.secure_path.encoded_by_secure_mod`); a plain train message carrying the
    seed is refused. Error replies, and replies without an ArrayRecord (a mod further in that
    answered by itself), are passed on unchanged too.

    Raises
    ------
    CompositionError
        The reply is not dense weights under the received keys (e.g. the mod was placed
        after a mod that already compressed, or the app returns a different model), the reply
        holds several ArrayRecords, the message holds several ConfigRecords of which not exactly
        one is the train config (`request.train_config`; raised before the next mod is
        called), or Flower's client-side clipping did not bound the update (its mod sits outside ours).
    PayloadError
        A download refused before the app runs, whatever its form (dense weights, a first contact,
        payloads on the held copy; train or evaluate): a malformed payload, a float tensor that is not
        finite, a negative BatchNorm running variance, a model version not above the held one
        (`fedcomp.download.receiver.check_download`, `fedcomp.download.receiver.check_version`); the held
        copy is kept.
    ValueError
        Non-finite update (the residual is kept as it was); a train message carrying the SecAgg+
        shared seed outside this node's secure mod (logged). Flower turns it into an error reply
        that the server counts as a failed client.
    """
    legacy = expand_legacy_message(msg) is not None  # a legacy API download (`fedcomp.download.legacy`)
    if not is_ours(msg):
        if not is_compressed_evaluate(msg):
            return call_next(msg, context)
        arr_key, rec = only_record(msg.content, "array")  # the model to evaluate rides the compressed download
        rebuild(msg, context, arr_key, rec, _version_config(msg))
        reply = call_next(msg, context)
        _report_copy(reply, context, legacy)
        return reply
    request = TrainRequest.parse(msg, context)  # refuses before training if local DP is below this node's floor
    download = sum(len(a.data) for a in request.arrays.values())
    # server-to-client compression: the dense model the message describes (the copy kept in context.state)
    # read-only views of the message's bytes, not copies: no second model held through training
    received, dtypes = numpy_views(rebuild(msg, context, request.array_key, request.arrays, request.config))

    reply = call_next(msg, context)
    if reply.has_error() or not reply.content.array_records:
        return reply  # an error, or an answer without weights: nothing to compress
    arr_key, trained = _trained_weights(reply)
    _check_client_clipping(request, received, trained)

    payloads, stats = _compress(request, context, received, trained, dtypes)
    stats["download-bytes"] = float(download)
    stats["clientapp-seconds"] = clientapp_seconds()  # a per-message ClientApp process: its whole life so far
    _write_reply(reply, arr_key, payloads, lean_report(stats, bool(request.config.get(LAYER_REPORT_KEY))))
    if MODEL_VERSION in request.config:
        _report_copy(reply, context, legacy)
    return reply


def _report_copy(reply: Message, context: Context, legacy: bool) -> None:
    """The copy's digest in the reply: its own record (`report_copy`), or for the legacy API in the legacy
    result's metrics, the only part of a reply a legacy strategy sees."""
    if not legacy:
        report_copy(reply, context)
    elif not reply.has_error():
        for key in (LEGACY_FIT_METRICS, "evaluateres.metrics"):
            if key in reply.content.config_records:
                reply.content.config_records[key].update(copy_digest_metric(context.state))


#: The metrics record of a legacy ``FitRes`` as Flower's compat layer carries it.
LEGACY_FIT_METRICS = "fitres.metrics"


def is_ours(msg: Message) -> bool:
    """Whether ``compression_mod`` compresses the reply to ``msg``: a train message with exactly one
    ArrayRecord that is not a step of SecAgg+ (Flower's ``secaggplus_configs`` record, or fedcomp's
    shared seed ``fedcomp-secagg-seed`` in a ConfigRecord while this node's secure mod encodes it).

    Raises
    ------
    ValueError
        The shared seed outside this node's secure mod (logged): a server must not be able to
        switch the node's compression and privacy floor off by adding a config key."""
    content = msg.content
    if msg.metadata.message_type.split(".")[0] != "train" or len(content.array_records) != 1:
        return False
    if RECORD_KEY_CONFIGS in content.config_records:
        return False  # a Flower SecAgg+ step: the masked vectors are the protocol's, not ours to compress
    if not any(SECAGG_SEED_KEY in c for c in content.config_records.values()):
        return True
    if encoded_by_secure_mod():
        return False  # this node's own secure mod encodes the update
    log(ERROR, "fedcomp: a train message carries the SecAgg+ shared seed '%s' but did not come through this node's "
        "secure-aggregation mod: refused (the server cannot switch this node's compression and privacy floor off)",
        SECAGG_SEED_KEY)
    raise ValueError(f"train message carries '{SECAGG_SEED_KEY}' outside this node's secure-aggregation mod: this "
                     "node compresses (and applies its own privacy floor to) every plain train reply; refused")


def is_compressed_evaluate(msg: Message) -> bool:
    """Whether ``msg`` is an evaluate message in the compressed download's form (one ArrayRecord, and a
    ConfigRecord with ``fedcomp-model-version``): ``compression_mod`` rebuilds the model it describes
    from this node's copy (`fedcomp.download.receiver.rebuild`) before the app evaluates it."""
    content = msg.content
    return (msg.metadata.message_type.split(".")[0] == "evaluate" and len(content.array_records) == 1
            and any(MODEL_VERSION in c for c in content.config_records.values()))


def _version_config(msg: Message):
    """The ConfigRecord of ``msg`` that carries the model version (the first, if several do)."""
    return next(c for c in msg.content.config_records.values() if MODEL_VERSION in c)


def lean_report(stats: dict, layers: bool = False) -> dict:
    """The figures a reply carries: ``stats`` without those the server counts itself (bytes up, down and
    fp32) or assumes when absent (zeros, the default link speeds:
    `fedcomp.protocol.messages.LEAN_DEFAULTS`), and without the per-layer lists unless the server
    asked for them (``layers``: the train config's ``fedcomp-report-layers``). Each figure costs its name
    and 9 bytes on the wire in every reply; at low density the full report was larger than the payload."""
    defaults = {**LEAN_DEFAULTS, **DEFAULT_LINK_MBPS}
    return {k: v for k, v in stats.items()
            if not (k in defaults and (defaults[k] is None or v == defaults[k]))
            and (layers or k not in ("layer-update-norm", "layer-compression-error"))}


def _trained_weights(reply: Message) -> tuple[str, dict[str, np.ndarray]]:
    """The reply's ArrayRecord key and its dense weights.

    Raises
    ------
    CompositionError
        Not exactly one ArrayRecord, or one that is already compressed.
    """
    arr_key, trained_rec = only_record(reply.content, "array")
    if any(a.stype == PAYLOAD_STYPE for a in trained_rec.values()):
        raise CompositionError("reply is already compressed: add compression_mod only once, as the first mod")
    return arr_key, numpy_views(trained_rec)[0]


def _check_client_clipping(request: TrainRequest, received: dict, trained: dict) -> None:
    """If the server asked for client-side clipping (Flower's ``clipping_norm``), the update that
    reaches this mod must already be clipped; otherwise Flower's clipping mod sits outside ours.

    The norm is the L2 norm of ``trained - received`` over the float tensors of at least one
    dimension: Flower's clipping mods (flwr 1.42, ``compute_clip_model_update``) scale those and
    leave a 0-d update as it was, so a 0-d tensor may exceed the bound with the mod in place.
    """
    clip = request.clipping_norm
    if clip is None or list(trained) != list(received):
        return
    clipped = [k for k in received if np.asarray(received[k]).dtype.kind == "f" and np.ndim(received[k]) > 0]
    norm = float(np.sqrt(sum(((np.asarray(trained[k], np.float64) - received[k]) ** 2).sum() for k in clipped)))
    if norm > clip * (1 + 1e-4):
        raise CompositionError(
            f"the server asked for client-side clipping (clipping_norm={clip}) but the update reaching compression_mod "
            f"has norm {norm:.4g}: Flower's clipping mod must run INSIDE compression_mod, on the train handler: "
            "ClientApp(mods=[compression_mod]) and @app.train(mods=[fixedclipping_mod])")


def _compress(request: TrainRequest, context: Context, received: dict, trained: dict,
              dtypes: dict) -> tuple[dict[str, bytes], dict]:
    """Payloads of ``trained - received`` with this node's error-feedback state, and the metrics;
    the new state is kept (``context.state`` and the node's state file) with error feedback on."""
    files = state_files(context)
    kept_round, residuals = residuals_of(context, files, request.server_round)
    t0 = time.perf_counter()
    with warnings.catch_warnings():  # the old residual: read-only views of context.state, only read
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        payloads, new_res, stats = compress_update(received, trained, request.codec, residuals, request.seed,
                                                   request.local_dp, dtypes, request.clipping_norm)
    del residuals  # the old residual's bytes go when context.state lets them go (keep_residuals)
    stats["compress-seconds"] = time.perf_counter() - t0
    warn_saturation_once(context.node_id, stats["residual-saturated"], stats["residual-saturated-loss"])
    stats["residual-bytes"] = float(sum(r.nbytes for r in new_res.values()))
    stats.update(memory_report())  # after training and compressing: the round's peak RSS
    stats.update(_link_speeds(context))
    if request.codec.error_feedback == "ef21":  # the round of the last send h_i holds: the server checks it
        stats[ESTIMATE_ROUND_METRIC] = float(kept_round)
    if request.codec.error_feedback:
        keep_residuals(context, files, new_res, request.server_round)
    return payloads, stats


def warn_saturation_once(client, saturated: float, lost_fraction: float) -> bool:
    """Log one warning per ``client`` the first time its fp16 residual saturates.

    Parameters
    ----------
    client : hashable
        Who compressed (a node id).
    saturated : float
        Residual entries clamped to ±65504 this round (the reply's ``residual-saturated``,
        `fedcomp.compression.ErrorFeedback.last_saturated` summed over payloads).
    lost_fraction : float
        Largest relative L2 norm of a payload's update the clamp dropped (``residual-saturated-loss``).

    Returns
    -------
    bool
        Whether a warning was logged (on Flower's ``flwr`` logger, like the rest of fedcomp).
    """
    if not saturated or client in _SATURATION_WARNED:
        return False
    _SATURATION_WARNED.add(client)
    logging.getLogger("flwr").warning(
        "fedcomp: client %s: the fp16 error-feedback residual saturated %d entries at +-65504, losing %.1f %% of "
        "the update (relative L2) for good (reported each round as 'residual-saturated'; warned once): use "
        "residual-dtype = \"fp32\" or smaller updates", client, int(saturated), 100.0 * lost_fraction)
    return True


def _link_speeds(context: Context) -> dict[str, float]:
    """``uplink-mbps``/``downlink-mbps`` of this node: node config, else run config, else the defaults."""
    out = {}
    for key, default in DEFAULT_LINK_MBPS.items():
        v = context.node_config.get(key, context.run_config.get(key, default))
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not MIN_LINK_MBPS <= v < float("inf"):
            raise ValueError(f"node config '{key}' must be a finite number > 0 (megabits per second, at least "
                             f"{MIN_LINK_MBPS}), got {v!r}")
        out[key] = float(v)
    return out


def _write_reply(reply: Message, arr_key: str, payloads: dict[str, bytes], stats: dict) -> None:
    """Replace the reply's weights by the payloads; add ``stats`` to its (one) MetricRecord, or for a legacy
    result to its metrics (``fitres.metrics``, scalars only: the only metrics Flower's compat layer keeps)."""
    if LEGACY_FIT_METRICS in reply.content.config_records:  # as Flower's compat layer carries raw tensors
        reply.content[arr_key] = ArrayRecord({k: Array(dtype="", shape=(), stype=PAYLOAD_STYPE, data=payloads[k])
                                              for k in in_position_order(payloads)})
        reply.content.config_records[LEGACY_FIT_METRICS].update(
            {k: v for k, v in stats.items() if isinstance(v, (bool, int, float, str, bytes))})
        return
    reply.content[arr_key] = ArrayRecord({k: payload_array(p) for k, p in payloads.items()})
    metric_recs = reply.content.metric_records
    if len(metric_recs) == 1:
        mkey, mrec = next(iter(metric_recs.items()))
        merged = dict(mrec)
    else:
        mkey, merged = "metrics", {}
    merged.update(stats)
    reply.content[mkey] = MetricRecord(merged)
