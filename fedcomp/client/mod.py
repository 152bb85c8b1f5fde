"""``compression_mod``: the Flower client mod that turns trained weights into compressed updates."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict

from ..compression import ErrorFeedback, decompress
from ..config import CODEC_DEFAULTS, CodecConfig
from ..protocol import MODEL_KEY, PAYLOAD_DTYPE, PAYLOAD_STYPE, RESIDUAL_STATE_KEY


class CompositionError(RuntimeError):
    """The ClientApp's reply cannot be compressed as it stands (wrong mod order, missing keys)."""


def _only_record(content: RecordDict, kind: str) -> tuple[str, Any]:
    recs = content.array_records if kind == "array" else content.config_records
    if len(recs) != 1:
        raise CompositionError(f"compression_mod expects exactly one {kind} record in the message, found {len(recs)}")
    return next(iter(recs.items()))


def _codec_config(msg: Message, context: Context) -> CodecConfig:
    """Codec the server asked for in the train config, with node-config overrides applied."""
    merged: dict[str, Any] = {}
    if msg.content.config_records:
        _, cfg = _only_record(msg.content, "config")
        merged.update({k: v for k, v in cfg.items() if k in CODEC_DEFAULTS})
    merged.update({k: v for k, v in context.node_config.items() if k in CODEC_DEFAULTS})
    return CodecConfig.from_mapping(merged)


def _stream_seed(context: Context, msg: Message) -> int:
    """Seed of stochastic codecs: a hash of run seed, partition (or node id) and round."""
    cfg = dict(msg.content.config_records[next(iter(msg.content.config_records))]) if msg.content.config_records else {}
    node = context.node_config.get("partition-id", context.node_id)
    key = f"{context.run_config.get('seed', 0)}:{node}:{cfg.get('server-round', 0)}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


def compress_update(
    received: dict[str, np.ndarray], trained: dict[str, np.ndarray], codec: CodecConfig,
    residuals: dict[str, np.ndarray], seed: int | None = None,
) -> tuple[dict[str, bytes], dict[str, np.ndarray], dict[str, float]]:
    """Compress ``trained - received`` per parameter, with error feedback.

    Parameters
    ----------
    received, trained : dict of str to np.ndarray
        Global weights as received and the locally trained weights; same keys and shapes.
    codec : CodecConfig
        Codec and error-feedback settings.
    residuals : dict of str to np.ndarray
        Residuals from earlier rounds (may be empty); entries of another shape are ignored.
    seed : int, optional
        Seed of stochastic codecs.

    Returns
    -------
    (payloads, new_residuals, stats)
        Payload bytes per key (one per parameter, or one under ``MODEL_KEY`` holding the
        flattened, concatenated update when ``codec.scope == "model"``); residual per key (empty without error feedback); and
        ``upload-bytes``, ``dense-bytes`` (4 bytes per parameter), ``compression-error``
        (||v - v_hat|| / ||v|| over the whole model, v = update + residual) and
        ``residual-norm`` (L2 over the model).

    Raises
    ------
    CompositionError
        Keys or shapes differ between ``received`` and ``trained``.
    ValueError
        The update holds NaN/Inf (residuals are then left unchanged).
    """
    if list(received) != list(trained):
        missing = sorted(set(received) - set(trained))
        extra = sorted(set(trained) - set(received))
        raise CompositionError(
            f"trained weights have other keys than the received global model (missing {missing}, extra {extra}); "
            "the ClientApp must return the full model under the received names"
        )
    compressor = codec.build(seed=seed)
    deltas: dict[str, torch.Tensor] = {}
    for key, g in received.items():
        t = trained[key]
        if t.shape != g.shape:
            raise CompositionError(f"'{key}': trained shape {t.shape} differs from received {g.shape}")
        deltas[key] = torch.from_numpy(np.asarray(t, dtype=np.float32) - np.asarray(g, dtype=np.float32))
    dense = sum(4 * d.numel() for d in deltas.values())
    if codec.scope == "model":
        deltas = {MODEL_KEY: torch.cat([d.reshape(-1) for d in deltas.values()])}
    payloads: dict[str, bytes] = {}
    new_res: dict[str, np.ndarray] = {}
    sq_err = sq_norm = res_sq = 0.0
    for key, delta in deltas.items():
        if codec.error_feedback:
            ef = ErrorFeedback(compressor, residual_dtype=codec.residual_dtype)
            prev = residuals.get(key)
            if prev is not None and tuple(prev.shape) == tuple(delta.shape):
                ef.set_residual(prev)
            payloads[key] = ef.compress(delta)
            new_res[key] = ef.get_residual()
            sq_err += ef.last_sq_error
            sq_norm += ef.last_sq_norm
            res_sq += ef.residual_norm**2
        else:
            payloads[key] = compressor.compress(delta)
            d = delta.double()
            sq_err += float(((d - decompress(payloads[key]).double()) ** 2).sum())
            sq_norm += float((d**2).sum())
    stats = {
        "upload-bytes": float(sum(len(p) for p in payloads.values())),
        "dense-bytes": float(dense),
        "compression-error": (sq_err / sq_norm) ** 0.5 if sq_norm > 0 else 0.0,
        "residual-norm": res_sq**0.5,
    }
    return payloads, new_res, stats


def _link_speeds(context: Context) -> dict[str, float]:
    """``uplink-mbps``/``downlink-mbps`` of this node: node config, else run config, else 1 / 10."""
    out = {}
    for key, default in (("uplink-mbps", 1.0), ("downlink-mbps", 10.0)):
        v = context.node_config.get(key, context.run_config.get(key, default))
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"node config '{key}' must be a number > 0 (megabits per second), got {v!r}")
        out[key] = float(v)
    return out


def compression_mod(msg: Message, context: Context, call_next) -> Message:
    """Flower client mod: reply with compressed updates instead of dense weights.

    Place it first (outermost) in ``ClientApp(mods=[compression_mod, ...])``. On a
    ``train`` message it reads the codec from the train ConfigRecord (keys of
    :class:`fedcomp.config.CodecConfig`; node config keys of the same names override
    them, e.g. a slow device forcing ``compressor = "sign"``), lets the app train, then
    replaces the reply's ArrayRecord by one fedcomp payload per parameter of
    ``delta = returned - received`` (+ error-feedback residual, kept in
    ``context.state`` across rounds). Adds metrics ``upload-bytes`` (payload bytes),
    ``dense-bytes`` (fp32 cost), ``download-bytes`` (bytes of the received arrays),
    ``compression-error``, ``residual-norm``, ``residual-bytes`` (memory of the residual),
    ``compress-seconds`` and the node's ``uplink-mbps``/``downlink-mbps`` (node config, else
    run config; defaults 1 and 10) to the reply's MetricRecord. Other
    message types pass through untouched. Error replies pass through unchanged.

    Raises
    ------
    CompositionError
        The reply is not dense weights under the received keys (e.g. the mod was placed
        after a mod that already compressed, or the app returns a different model).
    ValueError
        Non-finite update (the residual is kept as it was); Flower turns it into an
        error reply that the server counts as a failed client.
    """
    if msg.metadata.message_type.split(".")[0] != "train":
        return call_next(msg, context)
    codec = _codec_config(msg, context)
    _, received_rec = _only_record(msg.content, "array")
    received = {k: a.numpy() for k, a in received_rec.items()}
    download = sum(len(a.data) for a in received_rec.values())
    seed = _stream_seed(context, msg)

    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    arr_key, trained_rec = _only_record(reply.content, "array")
    if any(a.stype == PAYLOAD_STYPE for a in trained_rec.values()):
        raise CompositionError("reply is already compressed: add compression_mod only once, as the first mod")
    trained = {k: a.numpy() for k, a in trained_rec.items()}

    residuals: dict[str, np.ndarray] = {}
    if RESIDUAL_STATE_KEY in context.state:
        residuals = {k: a.numpy() for k, a in context.state[RESIDUAL_STATE_KEY].items()}
    t0 = time.perf_counter()
    payloads, new_res, stats = compress_update(received, trained, codec, residuals, seed)
    stats["compress-seconds"] = time.perf_counter() - t0
    stats["residual-bytes"] = float(sum(r.nbytes for r in new_res.values()))
    stats.update(_link_speeds(context))
    if codec.error_feedback:
        context.state[RESIDUAL_STATE_KEY] = ArrayRecord({k: Array(v) for k, v in new_res.items()})

    reply.content[arr_key] = ArrayRecord(
        {k: Array(dtype=PAYLOAD_DTYPE, shape=(len(p),), stype=PAYLOAD_STYPE, data=p) for k, p in payloads.items()}
    )
    stats["download-bytes"] = float(download)
    metric_recs = reply.content.metric_records
    if len(metric_recs) == 1:
        mkey, mrec = next(iter(metric_recs.items()))
        merged = dict(mrec)
    else:
        mkey, merged = "metrics", {}
    merged.update(stats)
    reply.content[mkey] = MetricRecord(merged)
    return reply


__all__ = ["CompositionError", "compress_update", "compression_mod"]
