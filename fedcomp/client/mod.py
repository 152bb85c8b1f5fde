"""``compression_mod``: the Flower client mod that turns trained weights into compressed updates."""

from __future__ import annotations

import fnmatch
import hashlib
import os
import pathlib
import time
from logging import WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.common.logger import log

from ..compression import ErrorFeedback, decompress, flatten_states, unflatten_states
from ..config import CODEC_DEFAULTS, SPARSE_CODECS, CodecConfig
from ..privacy import LocalDP, clip_and_noise
from ..protocol import (
    MODEL_KEY,
    MODEL_META_KEY,
    MODEL_STATE_KEY,
    PAYLOAD_DTYPE,
    PAYLOAD_STYPE,
    RESIDUAL_STATE_KEY,
    server_round,
)


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
    return CodecConfig.from_mapping(merged, source="train/node config")


def _stream_seed(context: Context, msg: Message) -> int:
    """Seed of stochastic codecs: a hash of run seed, partition (or node id) and round."""
    node = context.node_config.get("partition-id", context.node_id)
    key = f"{context.run_config.get('seed', 0)}:{node}:{server_round(msg)}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


def plan_units(shapes: dict[str, tuple[int, ...]], codec: CodecConfig) -> list[tuple[str, list[str], str]]:
    """Group parameters into payloads: ``[(payload key, member parameter names, codec name), ...]``.

    Per parameter, in order: the first ``layer-codecs`` rule whose pattern matches its name;
    else ``small-tensor-compressor`` if it has fewer than ``min-compress-numel`` elements;
    else the default ``compressor``. Default-codec parameters share one payload under
    ``MODEL_KEY`` (their updates flattened and concatenated in model order) when the scope is
    "model"; every other parameter gets its own payload under its own name.
    """
    rules = codec.rules
    default: list[str] = []
    units: list[tuple[str, list[str], str]] = []
    for key, shape in shapes.items():
        rule = next((c for pat, c in rules if fnmatch.fnmatchcase(key, pat)), None)
        n = int(np.prod(shape)) if shape else 1
        if rule is not None:
            units.append((key, [key], rule))
        elif n < codec.min_compress_numel:
            units.append((key, [key], codec.small_tensor_compressor))
        elif codec.scope == "model":
            default.append(key)
        else:
            units.append((key, [key], codec.compressor))
    if default:
        units.append((MODEL_KEY, default, codec.compressor))
    return units


def adaptive_density(v: torch.Tensor, codec_name: str, target: float, lo: float, hi: float) -> float:
    """Smallest density in [lo, hi] whose relative error on ``v`` is <= ``target`` (else ``hi``).

    One sort of ``|v|`` and cumulative sums give every k's error at once: top-k leaves
    ``||v||^2 - sum_{i<=k} v_(i)^2``; STC (all kept values -> ±mu) leaves
    ``||v||^2 - (sum_{i<=k} |v|_(i))^2 / k``.
    """
    n = v.numel()
    mag = torch.sort(v.detach().abs().reshape(-1).double(), descending=True).values
    total = float((mag**2).sum())
    if n == 0 or total == 0.0:
        return lo
    k = torch.arange(1, n + 1, dtype=torch.float64)
    kept = torch.cumsum(mag, 0) ** 2 / k if codec_name == "stc" else torch.cumsum(mag**2, 0)
    err = torch.sqrt(torch.clamp(total - kept, min=0.0) / total)
    k_lo, k_hi = max(int(round(lo * n)), 1), max(int(round(hi * n)), 1)
    ok = torch.nonzero(err[k_lo - 1 : k_hi] <= target)
    return (k_lo + int(ok[0])) / n if len(ok) else hi


def compress_update(
    received: dict[str, np.ndarray], trained: dict[str, np.ndarray], codec: CodecConfig,
    residuals: dict[str, np.ndarray], seed: int | None = None, local_dp: LocalDP | None = None,
) -> tuple[dict[str, bytes], dict[str, np.ndarray], dict[str, Any]]:
    """Compress ``trained - received``, parameter by parameter or as one model vector, with error feedback.

    Parameters
    ----------
    received, trained : dict of str to np.ndarray
        Global weights as received and the locally trained weights; same keys and shapes.
    codec : CodecConfig
        Codec, per-layer policy, adaptive density and error-feedback settings.
    residuals : dict of str to np.ndarray
        Residuals from earlier rounds, by payload key (may be empty); entries of another
        shape are ignored (the residual restarts at 0).
    seed : int, optional
        Seed of stochastic codecs and of local-DP noise.
    local_dp : LocalDP, optional
        Clip the whole update and add Gaussian noise first, before error feedback and
        compression (so every selection is made on the noisy update, and the residual is
        kept of the noisy vector).

    Returns
    -------
    (payloads, new_residuals, stats)
        Payload bytes per payload key (see :func:`plan_units`); residual per payload key
        (empty without error feedback); and ``upload-bytes``, ``dense-bytes`` (4 bytes per
        parameter), ``compression-error`` (||v - v_hat|| / ||v|| over the model, v = update +
        residual), ``residual-norm``, ``density`` (of the default sparse codec, adaptive or
        not; 0 for dense codecs) and per-parameter lists in model order
        ``layer-update-norm`` (||update||) and ``layer-compression-error``.

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
    deltas: dict[str, torch.Tensor] = {}
    for key, g in received.items():
        t = trained[key]
        if t.shape != g.shape:
            raise CompositionError(f"'{key}': trained shape {t.shape} differs from received {g.shape}")
        deltas[key] = torch.from_numpy(np.asarray(t, dtype=np.float32) - np.asarray(g, dtype=np.float32))
    units = plan_units({k: tuple(d.shape) for k, d in deltas.items()}, codec)
    # Validate every update before touching any residual ("loses nothing" on bad input).
    for key, d in deltas.items():
        if d.numel() and not bool(torch.isfinite(d).all()):
            raise ValueError(f"update of '{key}' holds non-finite values (NaN or Inf); refusing to compress")
    if local_dp is not None:
        gen = torch.Generator().manual_seed(seed if seed is not None else 0)
        flat = clip_and_noise(torch.cat([d.reshape(-1) for d in deltas.values()]), local_dp.clipping_norm,
                              local_dp.noise_multiplier, gen)
        off = 0
        for key, d in deltas.items():
            deltas[key] = flat[off : off + d.numel()].reshape(d.shape)
            off += d.numel()
    payloads: dict[str, bytes] = {}
    states = unflatten_states(residuals)  # residual (+ momentum, codec memory) per payload key
    new_states: dict[str, dict[str, np.ndarray]] = {}
    layer_sq_err: dict[str, float] = {}
    layer_sq_norm: dict[str, float] = {}
    used_density = 0.0
    for ukey, members, name in units:
        x = torch.cat([deltas[k].reshape(-1) for k in members]) if ukey == MODEL_KEY else deltas[ukey]
        prev = states.get(ukey, {}).get("residual") if codec.error_feedback else None
        if prev is not None and tuple(prev.shape) != tuple(x.shape):
            log(WARNING, "fedcomp: residual for '%s' has shape %s, the update %s: starting from zero", ukey,
                tuple(prev.shape), tuple(x.shape))
            prev = None
        v = x.float() if prev is None else x.float() + torch.as_tensor(prev).float()
        density = None
        if name == codec.compressor and name in SPARSE_CODECS:
            density = codec.density
            if codec.density_schedule == "adaptive":
                density = adaptive_density(v, name, codec.target_error, codec.density_min, codec.density_max)
            used_density = density
        compressor = codec.build(seed=seed, compressor=name, density=density)
        if codec.error_feedback:
            ef = ErrorFeedback(compressor, residual_dtype=codec.residual_dtype, momentum=codec.momentum_correction)
            for name in ef.set_state(states.get(ukey, {}), shape=tuple(x.shape)):
                if name != "residual":  # the residual's mismatch was logged above
                    log(WARNING, "fedcomp: saved %s for '%s' has another shape: starting from zero", name, ukey)
            payloads[ukey] = ef.compress(x)
            new_states[ukey] = ef.get_state()
            err = ef.residual.reshape(-1).float()
        else:
            payloads[ukey] = compressor.compress(x)
            err = (v - decompress(payloads[ukey], max_numel=max(v.numel(), 1))).reshape(-1)
        off = 0
        vflat = v.reshape(-1).double()
        for k in members:
            n = deltas[k].numel()
            layer_sq_err[k] = float((err[off : off + n].double() ** 2).sum())
            layer_sq_norm[k] = float((vflat[off : off + n] ** 2).sum())
            off += n
    sq_err, sq_norm = sum(layer_sq_err.values()), sum(layer_sq_norm.values())
    res_sq = sum(float((st["residual"].astype(np.float64) ** 2).sum()) for st in new_states.values())
    new_res = flatten_states(new_states)
    stats: dict[str, Any] = {
        "upload-bytes": float(sum(len(p) for p in payloads.values())),
        "dense-bytes": float(sum(4 * d.numel() for d in deltas.values())),
        "compression-error": (sq_err / sq_norm) ** 0.5 if sq_norm > 0 else 0.0,
        "residual-norm": res_sq**0.5,
        "density": float(used_density),
        "layer-update-norm": [float(torch.linalg.vector_norm(deltas[k].double())) for k in deltas],
        "layer-compression-error": [(layer_sq_err[k] / layer_sq_norm[k]) ** 0.5 if layer_sq_norm[k] > 0 else 0.0
                                    for k in deltas],
    }
    return payloads, new_res, stats


def _rebuild_downstream(msg: Message, context: Context, arr_key: str, rec: ArrayRecord) -> ArrayRecord:
    """Server-to-client compression: rebuild the model from a payload and the kept copy, and keep
    the model copy (with its version) in ``context.state`` whenever the server versions the model.

    Raises
    ------
    CompositionError
        A payload arrives but this node holds no model copy, or a copy of another version.
    """
    from ..strategies.downstream import BASE_VERSION, MODEL_VERSION

    _, cfg = _only_record(msg.content, "config") if msg.content.config_records else (None, {})
    if MODEL_VERSION not in cfg:
        return rec
    for key in (MODEL_VERSION, BASE_VERSION):
        v = cfg.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise CompositionError(f"train config '{key}' must be an integer >= 0, got {v!r}")
    if MODEL_KEY in rec:
        if MODEL_STATE_KEY not in context.state:
            raise CompositionError("received a compressed model but this node keeps no model copy (new node?)")
        held = int(context.state[MODEL_META_KEY]["version"])
        if held != cfg.get(BASE_VERSION):
            raise CompositionError(f"this node holds model version {held}, the payload applies to {cfg.get(BASE_VERSION)}")
        base = context.state[MODEL_STATE_KEY]
        flat = np.concatenate([a.numpy().astype(np.float32).ravel() for a in base.values()])
        flat = flat + decompress(rec[MODEL_KEY].data, max_numel=max(flat.size, 1),
                                 expected_shape=(flat.size,)).numpy()
        out, off = ArrayRecord(), 0
        for k, a in base.items():
            n = int(np.prod(a.shape)) if a.shape else 1
            out[k] = Array(np.ascontiguousarray(flat[off : off + n].reshape(a.shape)))
            off += n
        rec = out
        msg.content[arr_key] = rec
    context.state[MODEL_STATE_KEY] = ArrayRecord({k: Array(a.numpy().copy()) for k, a in rec.items()})
    context.state[MODEL_META_KEY] = MetricRecord({"version": int(cfg[MODEL_VERSION])})
    return rec


def _check_client_clipping(msg: Message, received: dict, trained: dict) -> None:
    """If the server asked for client-side clipping (Flower's ``clipping_norm``), the update that
    reaches this mod must already be clipped; otherwise Flower's clipping mod sits outside ours."""
    if not msg.content.config_records or list(trained) != list(received):
        return
    _, cfg = _only_record(msg.content, "config")
    clip = cfg.get("clipping_norm")
    if isinstance(clip, bool) or not isinstance(clip, (int, float)):
        return
    norm = float(np.sqrt(sum(((np.asarray(trained[k], np.float64) - received[k]) ** 2).sum() for k in received)))
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


def _local_dp(msg: Message) -> LocalDP | None:
    """Local update DP requested by the server in the train config (None if absent)."""
    if not msg.content.config_records:
        return None
    _, cfg = _only_record(msg.content, "config")
    if "local-dp-clipping-norm" not in cfg:
        return None
    return LocalDP(cfg["local-dp-clipping-norm"], cfg.get("local-dp-noise-multiplier", 0.0))


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
    arr_key_in, received_rec = _only_record(msg.content, "array")
    download = sum(len(a.data) for a in received_rec.values())
    received_rec = _rebuild_downstream(msg, context, arr_key_in, received_rec)
    received = {k: a.numpy() for k, a in received_rec.items()}
    seed = _stream_seed(context, msg)

    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    arr_key, trained_rec = _only_record(reply.content, "array")
    if any(a.stype == PAYLOAD_STYPE for a in trained_rec.values()):
        raise CompositionError("reply is already compressed: add compression_mod only once, as the first mod")
    trained = {k: a.numpy() for k, a in trained_rec.items()}
    _check_client_clipping(msg, received, trained)

    residuals: dict[str, np.ndarray] = {}
    state_file = _state_file(context)
    rnd = server_round(msg)
    if RESIDUAL_STATE_KEY in context.state:
        residuals = {k: a.numpy() for k, a in context.state[RESIDUAL_STATE_KEY].items()}
    elif state_file is not None:
        residuals = load_residuals(state_file, before_round=rnd)
    t0 = time.perf_counter()
    payloads, new_res, stats = compress_update(received, trained, codec, residuals, seed, _local_dp(msg))
    stats["compress-seconds"] = time.perf_counter() - t0
    stats["residual-bytes"] = float(sum(r.nbytes for r in new_res.values()))
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
