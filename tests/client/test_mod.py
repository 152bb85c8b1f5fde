"""compression_mod with hand-built Messages."""

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.clientapp.mod import fixedclipping_mod

import fedcomp.compression as fc
from fedcomp.client import CompositionError, compression_mod
from fedcomp.protocol.messages import MODEL_KEY, PAYLOAD_STYPE, RESIDUAL_STATE_KEY
from tests.messages import make_ctx, make_msg, reply_with, train_msg, weights


def run_mod(global_w, trained_w, config=None, ctx=None):
    msg = train_msg(global_w, config)
    ctx = ctx or make_ctx()
    reply = compression_mod(msg, ctx, lambda m, c: reply_with(m, trained_w))
    return reply, ctx


def test_reply_carries_payloads_of_the_delta():
    g, t = weights(0), weights(1)
    reply, _ = run_mod(g, t, {"compressor": "none"})
    rec = reply.content["arrays"]
    assert list(rec.keys()) == ["w", "b"]
    for k in rec:
        assert rec[k].stype == PAYLOAD_STYPE
        assert np.array_equal(fc.decompress(rec[k].data).numpy(), t[k] - g[k])


def test_metrics_count_real_payload_bytes():
    g, t = weights(0), weights(1)
    reply, _ = run_mod(g, t, {"compressor": "sign"})
    m = reply.content["metrics"]
    # the bytes each way are the server's to count (what it sent and received): a lean reply leaves them out
    assert not {"upload-bytes", "dense-bytes", "download-bytes"} & set(m)
    assert m["num-examples"] == 10 and m["train-loss"] == 0.5
    assert 0.0 < m["compression-error"] < 1.0
    assert m["residual-norm"] > 0.0
    assert "layer-update-norm" not in m  # per-layer figures only when the server asks for them


def test_residual_persists_in_context_state_and_is_used_next_round():
    g, t = weights(0), weights(1)
    ctx = make_ctx()
    _, ctx = run_mod(g, t, {"compressor": "topk", "density": 0.1, "selection": "tensor"}, ctx)
    res = {k: a.numpy() for k, a in ctx.state[RESIDUAL_STATE_KEY].items()}
    delta = {k: t[k] - g[k] for k in g}
    for k in g:
        sent = delta[k] - res[k]
        assert np.count_nonzero(sent) == max(round(0.1 * delta[k].size), 1)
    # next round with no change: exactly the residual's top entries go out
    reply, ctx = run_mod(g, g, {"compressor": "topk", "density": 1.0, "selection": "tensor"}, ctx)
    out = fc.decompress(reply.content["arrays"]["w"].data).numpy()
    assert np.allclose(out, res["w"])


def test_node_config_overrides_server_codec():
    g, t = weights(0), weights(1)
    reply, _ = run_mod(g, t, {"compressor": "topk"}, make_ctx(node_config={"compressor": "sign"}))
    assert fc.codec_name(reply.content["arrays"]["w"].data) == "sign"


def test_no_error_feedback_keeps_no_state():
    g, t = weights(0), weights(1)
    _, ctx = run_mod(g, t, {"compressor": "stc", "error-feedback": False})
    assert RESIDUAL_STATE_KEY not in ctx.state


def test_evaluate_messages_pass_through():
    msg = make_msg(RecordDict({"arrays": ArrayRecord(
                       {"w": __import__("flwr.app", fromlist=["Array"]).Array(np.ones(3))})}),
                   message_type="evaluate")
    sentinel = Message(content=RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)
    assert compression_mod(msg, make_ctx(), lambda m, c: sentinel) is sentinel


def test_nan_update_raises_and_keeps_residual():
    g, t = weights(0), weights(1)
    ctx = make_ctx()
    _, ctx = run_mod(g, t, {"compressor": "sign"}, ctx)
    before = ctx.state[RESIDUAL_STATE_KEY]["w"].numpy().copy()
    bad = {k: v.copy() for k, v in t.items()}
    bad["w"][0, 0] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        run_mod(g, bad, {"compressor": "sign"}, ctx)
    assert np.array_equal(ctx.state[RESIDUAL_STATE_KEY]["w"].numpy(), before)


def test_app_returning_other_keys_is_a_composition_error():
    g = weights(0)
    with pytest.raises(CompositionError, match="missing"):
        run_mod(g, {"w": g["w"]}, {"compressor": "sign"})


def test_bad_codec_config_names_the_key():
    g, t = weights(0), weights(1)
    with pytest.raises(ValueError, match="'density'"):
        run_mod(g, t, {"compressor": "stc", "density": 2.0})


def test_flower_dp_mod_after_ours_sees_dense_weights():
    """mods=[compression_mod, fixedclipping_mod]: Flower clips the dense update, we compress the clipped one."""
    g, t = weights(0), weights(1)
    msg = train_msg(g, {"compressor": "none", "clipping_norm": 1.0})

    def inner(m, c):
        return fixedclipping_mod(m, c, lambda m2, c2: reply_with(m2, t))

    reply = compression_mod(msg, make_ctx(), inner)
    delta = np.concatenate([fc.decompress(a.data).numpy().ravel() for a in reply.content["arrays"].values()])
    assert np.linalg.norm(delta) == pytest.approx(1.0, rel=1e-5)


def test_mod_placed_twice_is_reported():
    g, t = weights(0), weights(1)
    msg = train_msg(g, {"compressor": "sign"})

    def inner(m, c):
        return compression_mod(m, c, lambda m2, c2: reply_with(m2, t))

    with pytest.raises(CompositionError, match="only once"):
        compression_mod(msg, make_ctx(), inner)


def test_int_buffers_round_trip():
    g = {"w": np.ones((3,), np.float32), "n": np.array(5, dtype=np.int64)}
    t = {"w": np.full((3,), 2.0, np.float32), "n": np.array(9, dtype=np.int64)}
    reply, _ = run_mod(g, t, {"compressor": "none"})
    n = fc.decode_exact(reply.content["arrays"]["n"].data, (), np.int64)  # the value itself, exactly
    assert n.dtype == np.int64 and n.shape == () and int(n) == 9
    assert torch.equal(fc.decompress(reply.content["arrays"]["w"].data), torch.ones(3))


def test_model_selection_sends_one_payload_with_k_over_the_whole_model():
    g, t = weights(0), weights(1)
    reply, ctx = run_mod(g, t, {"compressor": "topk", "density": 0.1})  # auto -> model for topk
    rec = reply.content["arrays"]
    assert list(rec.keys()) == [MODEL_KEY]
    flat = fc.decompress(rec[MODEL_KEY].data).numpy()
    delta = np.concatenate([(t[k] - g[k]).ravel() for k in g])
    assert flat.shape == (210,) and np.count_nonzero(flat) == 21
    keep = np.argsort(-np.abs(delta))[:21]
    assert np.array_equal(flat[keep], delta[keep])
    assert list(ctx.state[RESIDUAL_STATE_KEY].keys()) == [MODEL_KEY]


def test_sign_defaults_to_one_scale_per_tensor():
    g, t = weights(0), weights(1)
    reply, _ = run_mod(g, t, {"compressor": "sign"})
    assert list(reply.content["arrays"].keys()) == ["w", "b"]


def test_fp16_residual_saturation_is_reported_and_warned_once_per_client(caplog):
    import logging

    from flwr.serverapp.strategy import FedAvg

    from fedcomp.statedict import FlatModel
    from fedcomp.strategies import CompressedStrategy

    g = {"w": np.zeros(1000, np.float32)}
    t = {"w": np.full(1000, 2e4, np.float32)}  # an update of 2e4 per entry, every round
    codec = {"compressor": "topk", "density": 0.01, "residual-dtype": "fp16"}
    ctx = make_ctx(node_id=4242)
    got = []
    with caplog.at_level(logging.WARNING, logger="flwr"):
        for _ in range(5):
            reply = compression_mod(train_msg(g, codec, dst=4242), ctx, lambda m, c: reply_with(m, t))
            got.append(reply.content["metrics"].get("residual-saturated", 0.0))  # 0: left out of a lean reply
    # Top-k sends 10 entries a round; the other residuals grow by 2e4 a round and pass 65504 in
    # round 4 (8e4): 970 entries hold 8e4 there, 10 of them are sent, 960 saturate.
    assert got[:3] == [0.0, 0.0, 0.0] and got[3] == 960.0 and got[4] > 0
    warned = [r for r in caplog.records if "saturated" in r.getMessage() and "4242" in r.getMessage()]
    assert len(warned) == 1 and "960 entries" in warned[0].getMessage()
    loss = (960 * (8e4 - 65504) ** 2 / (970 * 8e4**2 + 10 * (6e4**2 + 4e4**2 + 2e4**2))) ** 0.5
    assert f"{100 * loss:.1f} %" in warned[0].getMessage()

    # ... and the server sums it per round (the value metrics.json records).
    s = CompressedStrategy(FedAvg(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1),
                           compressor="topk", density=0.01)
    s.remember(1, FlatModel.from_numpy({"w": g["w"]}))
    replies = []
    for node in (1, 2):
        c = make_ctx(node_id=node)
        c.state = ctx.state  # the saturated residual of round 4
        replies.append(compression_mod(train_msg(g, codec, dst=node), c, lambda m, c_: reply_with(m, t)))
    _, _ = s.aggregate_train(1, replies)
    metrics = s.history[1]  # the round's own figures (Flower gets the headline ones)
    assert metrics["residual-saturated"] == sum(r.content["metrics"]["residual-saturated"] for r in replies) > 0
    assert s.history[1]["residual-saturated"] == metrics["residual-saturated"]


def test_saturation_warning_is_logged_once_per_client(caplog):
    import logging

    from fedcomp.client.mod import warn_saturation_once

    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert not warn_saturation_once("node-a", 0, 0.0)  # nothing saturated: silent
        assert warn_saturation_once("node-a", 970, 0.435)
        assert not warn_saturation_once("node-a", 990, 0.5)  # once per client
        assert warn_saturation_once("node-b", 3, 0.001)
    msgs = [r.getMessage() for r in caplog.records if "saturated" in r.getMessage()]
    assert len(msgs) == 2 and "970 entries" in msgs[0] and "43.5 %" in msgs[0] and "node-b" in msgs[1]
