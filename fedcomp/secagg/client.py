"""Client mods for compressed updates under Flower's SecAgg+.

``ClientApp(mods=[packing_secaggplus_mod, shared_randomk_mod])`` (or Flower's own
``secaggplus_mod`` first, without packing). Flower's ``secaggplus_mod`` does all the
cryptography (keys, secret shares, masks, dropout recovery); ``shared_randomk_mod`` runs inside it,
in the "collect masked vectors" stage, and changes only *what* is masked: instead of the dense
weights it returns the k entries of the error-feedback-corrected update that the round's shared
seed selects (after the shared rotation if asked), pre-rounded onto SecAgg+'s quantization grid.
``packing_secaggplus_mod`` wraps Flower's mod and packs the masked values (each in
``[0, modulus_range)``) at ``log2(modulus_range)`` bits instead of int64; the masking is untouched.

fedcomp's own ClientApp uses `secagg_mod` (both, and only for SecAgg+ messages) in front of
``compression_mod``.
"""

from __future__ import annotations

import sys
from logging import ERROR, WARNING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.client.mod import secaggplus_mod
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.logger import log
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, RECORD_KEY_STATE, Key, Stage
from flwr.compat.common import recorddict_compat as compat

from fedcomp.config.secagg import SECAGG_CODECS
from fedcomp.protocol.messages import (
    SECAGG_APPLIED_KEY,
    SECAGG_DDP_NOISE_KEY,
    SECAGG_DP_CLIP_KEY,
    SECAGG_KEYS_KEY,
    SECAGG_PACK_KEY,
    SECAGG_ROTATION_KEY,
    SECAGG_SEED_KEY,
)
from fedcomp.download.secagg import receive_fit_model, report_copy
from fedcomp.secagg.encoding import SharedProjection, add_noise_share, flower_weight, prequantize, weight_floor
from fedcomp.secagg.guard import check_request
from fedcomp.secagg.protocol_packing import PACK_KEY, compact_private_key, pack_masked, pack_record, unpack_record

#: ``context.state`` record: whether this round's setup request asked for packed keys and tokens.
PACKING_STATE_KEY = "fedcomp.secagg-packing"

_warned_dense = False


def _is_train(msg: Message) -> bool:
    return msg.metadata.message_type.split(".")[0] == MessageType.TRAIN


def _secagg_state(ctxt: Context) -> ConfigRecord:
    if RECORD_KEY_STATE not in ctxt.state.config_records:
        raise RuntimeError("shared_randomk_mod must run inside Flower's secaggplus_mod: "
                           "ClientApp(mods=[secaggplus_mod, shared_randomk_mod])")
    return ctxt.state.config_records[RECORD_KEY_STATE]


def _float_layout(arrays: list[np.ndarray]) -> list[tuple[int, int, int]]:
    """(index, offset, numel) of every float array in the flattened update."""
    out, off = [], 0
    for i, a in enumerate(arrays):
        if a.dtype.kind == "f":
            out.append((i, off, a.size))
            off += a.size
    return out


def check_node_floor(ctxt: Context, cfg: dict) -> None:
    """Refuse a secure round that would lower this node's own settings (node config wins, always).

    Under SecAgg+ every client sends the round's shared random-k at the server's ``density`` and no
    local noise: a node whose own config asks for local DP (``dp = "local"``), for distributed DP
    (``dp = "distributed"``) with a higher ``noise-multiplier`` than the server's (or none, or no valid
    clipping norm, without which no noise share is added), for a codec the
    secure path cannot use, or for a lower ``density`` than the server's does not train.

    Raises
    ------
    ValueError
        Naming the node-config key and what the server asked (logged at ERROR).
    """
    from fedcomp.client.request import own_local_dp  # client-side only: the server app loads no fedcomp.client

    node = ctxt.node_config
    problem = None
    if own_local_dp(ctxt) is not None:
        problem = ("its config sets dp = 'local' (a local-DP floor), and the secure path adds no local noise: the "
                   "server cannot switch it off")
    elif node.get("dp") == "distributed" and not (
            isinstance(cfg.get(SECAGG_DDP_NOISE_KEY), (int, float))
            and float(cfg[SECAGG_DDP_NOISE_KEY]) >= float(node.get("noise-multiplier", 1.0))):
        asked = ('no distributed noise' if cfg.get(SECAGG_DDP_NOISE_KEY) is None
                 else 'noise multiplier ' + str(cfg[SECAGG_DDP_NOISE_KEY]))
        problem = (f"its config sets dp = 'distributed' with noise-multiplier {node.get('noise-multiplier', 1.0)}, the "
                   f"server asked for {asked}")
    elif node.get("dp") == "distributed" and not _positive_number(cfg.get(SECAGG_DP_CLIP_KEY)):
        # without a clipping norm the client would clip nothing and add no noise share
        problem = (f"its config sets dp = 'distributed', the server sent no valid clipping norm "
                   f"({SECAGG_DP_CLIP_KEY} = {cfg.get(SECAGG_DP_CLIP_KEY)!r}; a number > 0), so no noise would "
                   "be added")
    elif "compressor" in node and node["compressor"] not in SECAGG_CODECS:
        problem = (f"its config sets compressor = {node['compressor']!r}, which cannot run under secure aggregation "
                   f"({list(SECAGG_CODECS)} can)")
    elif (node.get("compressor", "randomk") == "randomk" and isinstance(node.get("density"), (int, float))
          and float(node["density"]) < float(cfg.get("density", 1.0))):
        problem = (f"its config sets density = {node['density']}, the server asked for density = {cfg.get('density')} "
                   "(more of the update than this node sends)")
    if problem:
        log(ERROR, "fedcomp secagg: node %s refuses the secure round: %s", ctxt.node_id, problem)
        raise ValueError(f"this node refuses the secure round: {problem}")


def _positive_number(v) -> bool:
    """Whether ``v`` is a finite int or float > 0 (not a bool)."""
    # not NaN, inf, ints past float range
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= sys.float_info.max


def _train(msg: Message, ctxt: Context, call_next, global_arrays: list[np.ndarray], cfg: dict):
    """Run the inner app; returns (trained arrays in order, num_examples, metrics) or an error Message.

    With ``fedcomp-secagg-keys`` in the config the inner app is a Message-API train handler
    (content ``arrays`` with the parameter names, ``config``); otherwise a legacy app
    (NumPyClient) that reads and writes ``fitins.*`` / ``fitres.*`` records.
    """
    from fedcomp.client.secure_path import secure_encoding  # client-side only (see check_node_floor)

    names = cfg.get(SECAGG_KEYS_KEY)
    if names:
        if len(names) != len(global_arrays):
            raise ValueError(f"train config names {len(names)} parameters, the message carries {len(global_arrays)}")
        content = RecordDict({"arrays": ArrayRecord({n: Array(np.array(a, copy=True, order="C"))
                                                     for n, a in zip(names, global_arrays)}),
                              "config": ConfigRecord(cfg)})
        with secure_encoding():  # compression_mod steps aside only inside this call
            reply = call_next(Message(content=content, metadata=msg.metadata), ctxt)
        if reply.has_error():
            return reply
        recs = reply.content.array_records
        if len(recs) != 1:
            raise ValueError(f"the train handler must reply with one ArrayRecord, got {len(recs)}")
        rec = next(iter(recs.values()))
        if list(rec.keys()) != list(names):
            raise ValueError("the train handler replied with other parameter names than it received")
        trained = [rec[n].numpy() for n in names]
        metrics = dict(next(iter(reply.content.metric_records.values()))) if reply.content.metric_records else {}
        n = metrics.get("num-examples", metrics.get("num_examples"))
        if isinstance(n, bool) or not isinstance(n, (int, float)) or n < 0:
            raise ValueError(f"the train handler's metrics need a 'num-examples' >= 0, got {n!r}")
        return trained, int(n), metrics
    reply = call_next(msg, ctxt)
    if reply.has_error():
        return reply
    fitres = compat.recorddict_to_fitres(reply.content, keep_input=True)
    return parameters_to_ndarrays(fitres.parameters), int(fitres.num_examples), dict(fitres.metrics)


def shared_randomk_mod(msg: Message, ctxt: Context, call_next) -> Message:
    """Flower client mod (inside ``secaggplus_mod``): reply with the round's shared k entries of the
    error-feedback-corrected update, pre-rounded onto SecAgg+'s grid, as the vector to mask.

    Reads the round's seed, ``density``, ``fedcomp-secagg-rotation`` and ``error-feedback`` from
    the train config (sent by `fedcomp.secagg.SharedRandomKStrategy`) and c, Q and
    ``max_weight`` from SecAgg+'s own state. Only float tensors are encoded (flattened in order,
    d entries); integer and bool tensors keep the server's values. The reply is a legacy FitRes
    whose single array holds k float64 values; Flower then multiplies them by the client's weight
    ``round(num_examples / max_weight * Q) / Q``, quantizes (exactly, as they lie on its grid),
    and masks. The residual (float32, d entries) stays in ``context.state`` (and the state dir), pending
    until the server reports this round's sum applied with this vector (`fedcomp.secagg.residual`).

    Adds metrics ``secagg-k``, ``secagg-clipped`` (entries clipped to +-c), ``dense-bytes``
    (fp32 cost of the float update), ``compression-error`` and ``residual-norm``.

    A client whose ``num_examples`` rounds to weight 0 (below
    `fedcomp.secagg.encoding.weight_floor`, ``max_weight / Q``) reports that floor instead: it
    is weighted at one step ``1 / Q``.

    Client-level DP (``fedcomp-secagg-dp-clip`` = C in the train config, error feedback off): the
    client reports ``num_examples = max_weight`` to SecAgg+ (uniform weights, so one client moves
    the sum by at most C) and clips its k values to L2 norm ``C - sqrt(k) * 2c / Q``, so that the
    values after rounding onto the grid stay within C; the server adds the noise
    (`fedcomp.secagg.SharedRandomKStrategy` with ``client_dp``).

    Distributed DP (``fedcomp-secagg-ddp-noise`` = z as well): the same uniform weights and clipping,
    then the client adds its share of integer Skellam noise to its values on the grid, of variance
    ``(z C / step)**2 / t`` per value with t the round's SecAgg+ threshold from Flower's own client
    state, drawn from the OS CSPRNG (`fedcomp.privacy.distributed`); the server adds nothing.

    Raises
    ------
    ValueError
        ``num_examples`` outside ``(0, max_weight]`` (the dense path without a shared seed too: Flower's
        mod would only warn and mask an outsized weight); a non-finite update (the residual is kept as it was); a
        reply under other names than received; a round that would lower this node's own settings
        (`check_node_floor`); distributed DP at a SecAgg+ weight other than 1 (a fractional
        ``max_weight``). Flower turns it into an error reply: SecAgg+ then
        treats this client as dropped.
    """
    from fedcomp.secagg.residual import keep_residual, settled_residual  # client-side only (see check_node_floor)

    global _warned_dense
    if not _is_train(msg):
        return call_next(msg, ctxt)
    cfg = dict(msg.content.config_records["fitins.config"])
    check_node_floor(ctxt, cfg)  # dense SecAgg+ too: the node's own settings win
    if SECAGG_SEED_KEY not in cfg:
        if not _warned_dense:
            log(WARNING, "fedcomp: the server sent no shared seed (no SharedRandomKStrategy): dense SecAgg+ update")
            _warned_dense = True
        reply = call_next(msg, ctxt)
        if not reply.has_error():  # Flower's mod only warns: bound the weight it will mask to (0, max_weight]
            st = _secagg_state(ctxt)
            n = compat.recorddict_to_fitres(reply.content, keep_input=True).num_examples
            flower_weight(n, float(st["max_weight"]), int(st["target_range"]))
        return reply
    state = _secagg_state(ctxt)
    c, q, max_weight = float(state["clipping_range"]), int(state["target_range"]), float(state["max_weight"])
    global_arrays = parameters_to_ndarrays(compat.arrayrecord_to_parameters(
        msg.content.array_records["fitins.parameters"], keep_input=True))
    out = _train(msg, ctxt, call_next, global_arrays, cfg)
    if isinstance(out, Message):
        return out
    trained, num_examples, metrics = out
    if len(trained) != len(global_arrays) or any(t.shape != g.shape for t, g in zip(trained, global_arrays)):
        raise ValueError("the trained model's arrays differ in number or shape from the received model")
    layout = _float_layout(global_arrays)
    dim = sum(n for _, _, n in layout)
    delta = np.empty(dim, dtype=np.float64)
    for i, off, n in layout:
        delta[off : off + n] = (trained[i].astype(np.float64).reshape(-1)
                                - global_arrays[i].astype(np.float64).reshape(-1))
    if not np.isfinite(delta).all():
        raise ValueError("non-finite update: the client does not send it (its residual is kept)")
    ef = bool(cfg.get("error-feedback", True))
    dp_clip = cfg.get(SECAGG_DP_CLIP_KEY)
    if dp_clip is not None and not _positive_number(dp_clip):  # NaN would clip nothing: refuse, do not send
        raise ValueError(f"the server's DP clipping norm ({SECAGG_DP_CLIP_KEY}) must be a finite number > 0, got "
                         f"{dp_clip!r}: the client does not send an unclipped update")
    if dp_clip is not None and ef:
        raise ValueError("client-level DP under SecAgg+ needs error-feedback = false: the residual would carry the "
                         "clipped excess into later rounds and void the clipping bound")
    applied = cfg.get(SECAGG_APPLIED_KEY)
    applied = int(applied) if isinstance(applied, int) and not isinstance(applied, bool) else None
    residual = settled_residual(ctxt, applied, dim, int(cfg.get("server-round", 0))) if ef else None
    corrected = delta if residual is None else delta + residual
    proj = SharedProjection(dim, float(cfg["density"]), int(cfg[SECAGG_SEED_KEY]), bool(cfg.get(SECAGG_ROTATION_KEY)))
    reported = num_examples
    values, rotated = proj.encode(corrected)
    dp_clipped = 0
    ddp = None
    if dp_clip is not None and cfg.get(SECAGG_DDP_NOISE_KEY) is not None:
        from fedcomp.privacy.distributed import DistributedDP

        ddp = DistributedDP(float(dp_clip), float(cfg[SECAGG_DDP_NOISE_KEY]), c, q)
        ddp.check_range(int(state["threshold"]))  # its noisy values must stay inside SecAgg+'s [-c, c]
    if dp_clip is not None:
        # DP: uniform weights (every client reports max_weight) and ||sent|| <= C, the rounding onto the grid
        # (< one step per entry) included
        reported = int(max_weight)
        weight = flower_weight(reported, max_weight, q)
        if ddp is not None and weight != 1.0:  # Flower would rescale and re-round each noisy value on its own
            raise ValueError(f"dp = 'distributed' needs each client's SecAgg+ weight to be exactly 1 (its noise share "
                             f"on the grid), but secagg-max-weight = {max_weight:g} gives {weight:g}: use an integer "
                             "'secagg-max-weight'")
        bound = float(dp_clip) - np.sqrt(proj.k) * 2 * c / q / weight
        if bound <= 0:
            raise ValueError(f"DP clipping norm {dp_clip} is below the quantization slack sqrt(k) * 2c / Q: raise "
                             "'clipping-norm' or 'secagg-quantization-bits'")
        norm_v = float(np.linalg.norm(values))
        if norm_v > bound:
            values *= bound / norm_v
            dp_clipped = 1
    else:
        if 0 < num_examples < weight_floor(max_weight, q):  # weighted at one step 1/Q, not refused
            reported = weight_floor(max_weight, q)
        weight = flower_weight(reported, max_weight, q)
    sent, clipped = prequantize(values, weight, c, q, np.random.default_rng())  # OS entropy
    rotated.numpy()[proj.positions()] -= sent
    if ddp is not None:  # its share of the noise, on the grid: the masked sum carries the sum of the shares
        sent = add_noise_share(sent, ddp, proj.k, int(state["threshold"]))
    new_residual = proj.unrotate_(rotated).numpy()
    norm = float(np.linalg.norm(corrected))
    res_norm = float(np.linalg.norm(new_residual))
    if ef:  # pending until the server reports this round's sum applied with this vector
        keep_residual(ctxt, residual, new_residual, int(cfg.get("server-round", 0)), applied)
    metrics = {k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bytes, bool))}
    metrics.update({"secagg-k": proj.k, "secagg-clipped": clipped, "dense-bytes": float(4 * dim),
                    "compression-error": res_norm / norm if norm > 0 else 0.0,
                    "residual-norm": res_norm if ef else 0.0, "secagg-dp-clipped": dp_clipped})
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([sent]), reported, metrics)
    return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=msg)


def packing_secaggplus_mod(msg: Message, ctxt: Context, call_next) -> Message:
    """Flower's ``secaggplus_mod``, with its masked vectors packed at ``log2(modulus_range)`` bits.

    Packs only when the server announced it can unpack (``fedcomp-secagg-pack = true`` in the
    train config, sent by `fedcomp.secagg.SharedRandomKStrategy` with ``pack=True`` and
    unpacked by `fedcomp.secagg.CompressedSecAggPlusWorkflow`). Every protocol step, mask
    and share is Flower's; this only re-encodes the masked integers of the reply and, where the
    setup request asks for it (`fedcomp.secagg.protocol_packing.PACK_KEY`), the public keys and
    encrypted shares both ways (`fedcomp.secagg.protocol_packing`); after the setup stage the private
    key this node shares with its neighbours is kept in its shortest PEM form (`compact_private_key`: the
    same key, shorter shares; any server reads it). Adds the reply's metric ``upload-bytes`` (bytes of
    the masked vectors as sent).

    Before Flower's mod sees a request, `fedcomp.secagg.guard.check_request` refuses a setup
    whose threshold is at most half the shares and an unmask request that asks for both shares of
    one node (raises `fedcomp.secagg.guard.UnsafeRequest`; Flower sends an error reply).
    """
    if _is_train(msg):
        check_request(msg, ctxt)  # a setup or unmask request that would unmask one client is refused
    pack = (_is_train(msg) and "fitins.config" in msg.content.config_records
            and bool(msg.content.config_records["fitins.config"].get(SECAGG_PACK_KEY, False)))
    request = msg.content.config_records.get(RECORD_KEY_CONFIGS) if _is_train(msg) else None
    stage = None if request is None else request.get(Key.STAGE)
    if stage == Stage.SETUP:  # the server unpacks SecAgg+'s keys and tokens this round, or not
        ctxt.state.config_records[PACKING_STATE_KEY] = ConfigRecord({"on": bool(request.get(PACK_KEY, False))})
    packing = stage is not None and bool(ctxt.state.config_records.get(PACKING_STATE_KEY, {}).get("on", False))
    if request is not None:
        unpack_record(stage, request)  # Flower's mod reads its own forms
    reply = secaggplus_mod(msg, ctxt, call_next)
    if reply.has_error() or not _is_train(msg):
        return reply
    state = ctxt.state.config_records.get(RECORD_KEY_STATE)
    if stage == Stage.SETUP and state is not None and isinstance(state.get("sk1"), bytes):
        state["sk1"] = compact_private_key(state["sk1"])  # the key this node shares, in its shortest form
    rec = reply.content.config_records.get(RECORD_KEY_CONFIGS)
    if rec is not None and packing:
        pack_record(stage, rec)
    if rec is None or Key.MASKED_PARAMETERS not in rec:
        return reply
    blobs = list(rec[Key.MASKED_PARAMETERS])
    if pack:
        from flwr.common import bytes_to_ndarray

        bits = int(ctxt.state.config_records[RECORD_KEY_STATE]["mod_range"]).bit_length() - 1
        blobs = [pack_masked(bytes_to_ndarray(b), bits) for b in blobs]
        rec[Key.MASKED_PARAMETERS] = blobs
    if "fitres.metrics" in reply.content.config_records:
        reply.content.config_records["fitres.metrics"]["upload-bytes"] = float(sum(len(b) for b in blobs))
    return reply


def secagg_mod(msg: Message, ctxt: Context, call_next) -> Message:
    """fedcomp's ClientApp mod: SecAgg+ messages go through `packing_secaggplus_mod` and
    `shared_randomk_mod` (then straight to the train handler); all others to ``call_next``.
    A train message whose model rides the compressed download (`fedcomp.download.secagg`) is rebuilt
    from this node's copy first, and the reply reports the copy's digest.

    Register it before ``compression_mod``: ``ClientApp(mods=[secagg_mod, compression_mod])``
    (``compression_mod`` lets the shared-seed train message through untouched).
    """
    if _is_train(msg) and RECORD_KEY_CONFIGS in msg.content.config_records:
        downloaded = receive_fit_model(msg, ctxt)
        reply = packing_secaggplus_mod(msg, ctxt, lambda m, c: shared_randomk_mod(m, c, call_next))
        if downloaded:
            report_copy(reply, ctxt)
        return reply
    return call_next(msg, ctxt)
