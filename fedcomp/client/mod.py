"""``compression_mod``: the Flower client mod that turns trained weights into compressed updates."""

from __future__ import annotations

import difflib
import hashlib
import os
import pathlib
import time
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.common.logger import log

from ..compression.error_feedback import warn_saturation_once
from ..config import CODEC_DEFAULTS, DP_MODES, CodecConfig
from ..device import peak_rss_mb
from ..privacy import LocalDP
from ..protocol import (
    PAYLOAD_DTYPE,
    PAYLOAD_STYPE,
    RESIDUAL_STATE_KEY,
    SECAGG_SEED_KEY,
    server_round,
)
from ..statedict import numpy_dict
from .downstream import rebuild
from .update import CompositionError, adaptive_density, compress_update, plan_units  # noqa: F401 (re-exported)


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
    return CodecConfig.from_mapping(merged, source="train/node config")


def _stream_seed(context: Context, msg: Message) -> int:
    """Seed of stochastic codecs: a hash of run seed, partition (or node id) and round."""
    node = context.node_config.get("partition-id", context.node_id)
    key = f"{context.run_config.get('seed', 0)}:{node}:{server_round(msg)}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


def _rebuild_downstream(msg: Message, context: Context, arr_key: str, rec: ArrayRecord) -> ArrayRecord:
    """Server-to-client compression: the dense model a downstream message describes
    (:func:`fedcomp.client.downstream.rebuild`, which keeps the copy in ``context.state``)."""
    cfg = _only_record(msg.content, "config")[1] if msg.content.config_records else {}
    return rebuild(msg, context, arr_key, rec, cfg)


def _check_client_clipping(msg: Message, received: dict, trained: dict) -> None:
    """If the server asked for client-side clipping (Flower's ``clipping_norm``), the update that
    reaches this mod must already be clipped; otherwise Flower's clipping mod sits outside ours."""
    if not msg.content.config_records or list(trained) != list(received):
        return
    _, cfg = _only_record(msg.content, "config")
    clip = cfg.get("clipping_norm")
    if isinstance(clip, bool) or not isinstance(clip, (int, float)):
        return
    norm = float(np.sqrt(sum(((np.asarray(trained[k], np.float64) - received[k]) ** 2).sum() for k in received
                             if np.asarray(received[k]).dtype.kind == "f")))  # float tensors: the update
    if norm > clip * (1 + 1e-4):
        raise CompositionError(
            f"the server asked for client-side clipping (clipping_norm={clip}) but the update reaching compression_mod "
            f"has norm {norm:.4g}: Flower's clipping mod must run INSIDE compression_mod, on the train handler: "
            "ClientApp(mods=[compression_mod]) and @app.train(mods=[fixedclipping_mod])")


def _state_file(context: Context) -> pathlib.Path | None:
    """``<state-dir>/residual-<partition-id or node id>.npz`` if node config ``state-dir`` (or run
    config ``client-state-dir``) names a folder, else None."""
    folder = context.node_config.get("state-dir") or context.run_config.get("client-state-dir") or ""
    if not isinstance(folder, str) or not folder:
        return None
    who = context.node_config.get("partition-id", context.node_id)
    return pathlib.Path(folder).expanduser() / f"residual-{who}.npz"


def save_residuals(path: pathlib.Path, residuals: dict[str, np.ndarray], server_round: int) -> None:
    """Persist error-feedback residuals (node-local file, atomic: temporary file then rename).

    Plain ``.npz`` of numeric arrays plus the round they were computed in; read back with
    ``allow_pickle=False``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, __round__=np.array(server_round, dtype=np.int64), **{f"r/{k}": v for k, v in residuals.items()})
    os.replace(tmp, path)


def load_residuals(path: pathlib.Path, before_round: int) -> dict[str, np.ndarray]:
    """Residuals saved by :func:`save_residuals` in a round before ``before_round`` ({} if none,
    unreadable, or from a later round, e.g. after the server resumed from an older checkpoint)."""
    if not path.exists():
        return {}
    try:
        with np.load(path, allow_pickle=False) as z:
            saved_round = int(z["__round__"].reshape(()))
            res = {k[2:]: z[k] for k in z.files if k.startswith("r/")}
        if not all(np.issubdtype(v.dtype, np.floating) and np.isfinite(v).all() for v in res.values()):
            raise ValueError("non-finite or non-float residual")
    except Exception as exc:  # noqa: BLE001 - a bad local file must not stop the node: start from zero
        log(WARNING, "fedcomp: ignoring unreadable residual file %s (%s: %s)", path, type(exc).__name__, exc)
        return {}
    return res if saved_round < before_round or before_round == 0 else {}


def _own_local_dp(context: Context) -> LocalDP | None:
    """This client's own local-DP floor: node config ``dp = "local"`` (with its ``noise-multiplier``
    and ``clipping-norm``), else the run config's; None if neither asks for local DP.

    Raises
    ------
    ValueError
        A ``dp`` value that is not one of :data:`fedcomp.config.DP_MODES` (``"Local"``, ``"locl"``):
        the client refuses rather than train with its privacy floor silently off."""
    for where, cfg in (("node config", context.node_config), ("run config", context.run_config)):
        if "dp" in cfg and cfg["dp"] not in DP_MODES:  # a slip ("Local") must not switch the privacy floor off
            close = difflib.get_close_matches(str(cfg["dp"]).lower(), DP_MODES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{where} 'dp' must be one of {list(DP_MODES)}, got {cfg['dp']!r}{hint}; "
                             "this client does not train with an unknown privacy setting")
        if cfg.get("dp") == "local":
            return LocalDP(cfg.get("clipping-norm", 1.0), cfg.get("noise-multiplier", 1.0))
        if "dp" in cfg:
            return None
    return None


def _local_dp(msg: Message, context: Context) -> LocalDP | None:
    """Local update DP for this round: the server's request (train config), checked against this
    client's own floor (:func:`_own_local_dp`).

    The privacy of a Gaussian release depends on the noise multiplier alone, so the server may pick
    the clipping norm, but never a noise multiplier below the client's own.

    Raises
    ------
    ValueError
        The client's own config asks for local DP and the server's train message asks for none or
        for a smaller noise multiplier: the client refuses to train (Flower sends an error reply).
    """
    cfg = _only_record(msg.content, "config")[1] if msg.content.config_records else {}
    server = (LocalDP(cfg["local-dp-clipping-norm"], cfg.get("local-dp-noise-multiplier", 0.0))
              if "local-dp-clipping-norm" in cfg else None)
    own = _own_local_dp(context)
    if own is not None and (server is None or server.noise_multiplier < own.noise_multiplier):
        asked = "no local DP" if server is None else f"noise multiplier {server.noise_multiplier}"
        raise ValueError(f"privacy floor: this client's config sets dp = 'local' with noise multiplier "
                         f"{own.noise_multiplier}, the server asked for {asked}; the client does not train")
    return server


def _link_speeds(context: Context) -> dict[str, float]:
    """``uplink-mbps``/``downlink-mbps`` of this node: node config, else run config, else 1 / 10."""
    out = {}
    for key, default in (("uplink-mbps", 1.0), ("downlink-mbps", 10.0)):
        v = context.node_config.get(key, context.run_config.get(key, default))
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            raise ValueError(f"node config '{key}' must be a finite number > 0 (megabits per second), got {v!r}")
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
    message types pass through untouched. Error replies pass through unchanged. So does a train
    message whose config carries the SecAgg+ shared seed (``fedcomp-secagg-seed``): under
    ``secagg = true`` the update is encoded by ``fedcomp.secagg.shared_randomk_mod``.

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
    if any(SECAGG_SEED_KEY in c for c in msg.content.config_records.values()):
        return call_next(msg, context)  # under SecAgg+: fedcomp.secagg's mod encodes this update
    codec = _codec_config(msg, context)
    arr_key_in, received_rec = _only_record(msg.content, "array")
    download = sum(len(a.data) for a in received_rec.values())
    received_rec = _rebuild_downstream(msg, context, arr_key_in, received_rec)
    received, dtypes = numpy_dict(received_rec)
    seed = _stream_seed(context, msg)
    local_dp = _local_dp(msg, context)  # refuses before training if the server asks below this client's floor

    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    arr_key, trained_rec = _only_record(reply.content, "array")
    if any(a.stype == PAYLOAD_STYPE for a in trained_rec.values()):
        raise CompositionError("reply is already compressed: add compression_mod only once, as the first mod")
    trained = numpy_dict(trained_rec)[0]
    _check_client_clipping(msg, received, trained)

    residuals: dict[str, np.ndarray] = {}
    state_file = _state_file(context)
    rnd = server_round(msg)
    if RESIDUAL_STATE_KEY in context.state:
        residuals = {k: a.numpy() for k, a in context.state[RESIDUAL_STATE_KEY].items()}
    elif state_file is not None:
        residuals = load_residuals(state_file, before_round=rnd)
    t0 = time.perf_counter()
    payloads, new_res, stats = compress_update(received, trained, codec, residuals, seed, local_dp, dtypes)
    stats["compress-seconds"] = time.perf_counter() - t0
    warn_saturation_once(context.node_id, stats["residual-saturated"], stats["residual-saturated-loss"])
    stats["residual-bytes"] = float(sum(r.nbytes for r in new_res.values()))
    stats["client-peak-rss-mb"] = peak_rss_mb()  # after training and compressing: the round's peak
    stats.update(_link_speeds(context))
    if codec.error_feedback:
        context.state[RESIDUAL_STATE_KEY] = ArrayRecord({k: Array(v) for k, v in new_res.items()})
        if state_file is not None:
            try:
                save_residuals(state_file, new_res, rnd)
            except OSError as exc:  # the in-memory residual stays consistent with what is sent
                log(WARNING, "fedcomp: cannot persist the residual to %s (%s)", state_file, exc)

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
