"""CompressedStrategy with hand-built replies and the in-process grid."""

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAdam, FedAvg

import fedcomp.compression as fc
from fedcomp.app.config import AppConfig
from fedcomp.protocol.messages import MODEL_KEY, PAYLOAD_DTYPE, PAYLOAD_STYPE
from fedcomp.run.inprocess_grid import InProcessGrid
from fedcomp.statedict import FlatModel
from fedcomp.strategies import CompressedStrategy
from tests.messages import train_msg, weights

from .helpers import compressed_reply, fedavg, setup


def test_none_codec_equals_plain_fedavg():
    g = weights(0)
    t1, t2 = weights(1), weights(2)
    s = CompressedStrategy(fedavg(), compressor="none")
    setup(s, g)
    arrays, _ = s.aggregate_train(1, [compressed_reply(g, t1, 1, n=10), compressed_reply(g, t2, 2, n=30)])
    metrics = s.history[1]  # the round's own figures (Flower gets the headline ones)
    for k in g:
        expect = (10 * t1[k] + 30 * t2[k]) / 40
        assert np.allclose(arrays[k].numpy(), expect, atol=1e-6)
    assert metrics["num-replies"] == 2 and metrics["rejected-replies"] == 0


def test_metrics_sum_real_bytes():
    g, t = weights(0), weights(1)
    s = CompressedStrategy(fedavg(), compressor="sign")
    setup(s, g)
    r1 = compressed_reply(g, t, 1, {"compressor": "sign"})
    r2 = compressed_reply(g, t, 2, {"compressor": "sign"})
    size = (sum(len(a.data) for a in r1.content["arrays"].values())
            + sum(len(a.data) for a in r2.content["arrays"].values()))
    _, _ = s.aggregate_train(1, [r1, r2])
    m = s.history[1]  # the round's own figures (Flower gets the headline ones)
    assert m["upload-bytes"] == float(size)
    assert m["upload-bytes-sign"] == float(size)
    assert m["dense-bytes"] == 2 * 4.0 * 210
    assert m["compression-ratio"] == pytest.approx(2 * 4.0 * 210 / size)


def corrupt(reply, how):
    rec = reply.content["arrays"]
    data = bytearray(rec["w"].data)
    if how == "truncate":
        data = data[:-3]
    elif how == "magic":
        data[0] ^= 0xFF
    elif how == "nan":
        data = bytearray(fc.get_compressor("none").compress(__import__("torch").zeros(20, 10)))
        data[-4:] = np.array([np.nan], dtype=np.float32).tobytes()
    elif how == "shape":
        data = bytearray(fc.get_compressor("none").compress(__import__("torch").zeros(10, 20)))
    elif how == "bomb":
        data = bytearray(fc.get_compressor("none").compress(__import__("torch").zeros(400)))
    rec["w"] = Array(dtype=PAYLOAD_DTYPE, shape=(len(data),), stype=PAYLOAD_STYPE, data=bytes(data))
    if how == "dense":
        rec["w"] = Array(np.zeros((20, 10), np.float32))
    if how == "missing":
        del rec["b"]
    if how == "extra":
        rec["zzz"] = rec["w"]
    return reply


@pytest.mark.parametrize("how", ["truncate", "magic", "nan", "shape", "bomb", "dense", "missing", "extra"])
def test_bad_reply_is_dropped_and_global_model_unaffected(how, caplog):
    g, t1, t2 = weights(0), weights(1), weights(2)
    s = CompressedStrategy(fedavg(), compressor="none")
    setup(s, g)
    clean, _ = s.aggregate_train(1, [compressed_reply(g, t1, 1)])
    setup(s, g)
    arrays, _ = s.aggregate_train(1, [compressed_reply(g, t1, 1), corrupt(compressed_reply(g, t2, 2), how)])
    m = s.history[1]  # the round's own figures (Flower gets the headline ones)
    assert m["rejected-replies"] == 1 and m["num-replies"] == 1
    for k in g:
        assert np.array_equal(arrays[k].numpy(), clean[k].numpy())
    assert "rejected reply from node 2" in caplog.text


def test_dense_reply_error_says_how_to_fix(caplog):
    g, t = weights(0), weights(1)
    s = CompressedStrategy(fedavg(), compressor="none")
    setup(s, g)
    s.aggregate_train(1, [corrupt(compressed_reply(g, t, 3), "dense")])
    assert "add compression_mod as the FIRST mod" in caplog.text


def test_error_replies_counted_as_failed():
    g, t = weights(0), weights(1)
    s = CompressedStrategy(fedavg(), compressor="none")
    setup(s, g)
    ok = compressed_reply(g, t, 1)
    failed = Message(Error(code=2, reason="boom"), reply_to=train_msg(g, dst=5))
    arrays, _ = s.aggregate_train(1, [ok, failed])
    m = s.history[1]  # the round's own figures (Flower gets the headline ones)
    assert m["failed-clients"] == 1 and m["num-replies"] == 1
    assert np.allclose(arrays["w"].numpy(), t["w"], atol=1e-6)


def test_untraceable_superlink_error_reply_is_reported_and_the_silent_node_still_counted(caplog):
    """Flower answers a lost task from the SuperLink's node id (1): one that names no message this round
    sent cannot be charged to a node; it is said as such (not a refused 'stranger'), and the sampled node
    without a reply (8) is still counted and named."""
    g, t = weights(0), weights(1)
    s = CompressedStrategy(fedavg(), compressor="none")
    s.remember(1, FlatModel.from_numpy(g), nodes={7, 8})
    ok = compressed_reply(g, t, 7)
    lost = Message(Error(code=0, reason="task lost: no heartbeat"), reply_to=train_msg(g, dst=1))
    assert lost.metadata.src_node_id == 1
    arrays, _ = s.aggregate_train(1, [ok, lost])
    m = s.history[1]  # the round's own figures (Flower gets the headline ones)
    assert m["failed-clients"] == 1 and m["rejected-replies"] == 0 and m["num-replies"] == 1
    assert m["uncharged-error-replies"] == 1
    assert [f["node"] for f in s.failure_history[1]] == [8]
    assert "round 1: client (node 8) failed: no reply before the round's timeout" in caplog.text
    assert "task lost: no heartbeat" in caplog.text and "not sent a message" not in caplog.text
    assert np.allclose(arrays["w"].numpy(), t["w"], atol=1e-6)


def test_all_rejected_leaves_model_unchanged():
    g, t = weights(0), weights(1)
    s = CompressedStrategy(fedavg(), compressor="none")
    setup(s, g)
    arrays, _ = s.aggregate_train(1, [corrupt(compressed_reply(g, t, 1), "magic")])
    m = s.history[1]  # the round's own figures (Flower gets the headline ones)
    assert arrays is None and m["rejected-replies"] == 1


def test_configure_train_adds_codec_to_config():
    from fedcomp.app.client_app import app as client_app

    grid = InProcessGrid(client_app, 2, {})
    s = CompressedStrategy(fedavg(), compressor="stc", density=0.05)
    cfg = ConfigRecord()
    msgs = list(s.configure_train(1, ArrayRecord(weights_as_state()), cfg, grid))
    assert len(msgs) == 2
    c = msgs[0].content["config"]
    assert c["compressor"] == "stc" and c["density"] == 0.05
    assert "error-feedback" not in c  # at its default (on): a key at its default is not sent


def weights_as_state():
    from fedcomp.task.models import build_model

    return build_model().state_dict()


def test_constructor_validation():
    with pytest.raises(ValueError, match="compressor"):
        CompressedStrategy(fedavg(), compressor="zip")
    with pytest.raises(ValueError, match="density"):
        CompressedStrategy(fedavg(), compressor="stc", density=0.0)
    with pytest.raises(TypeError) as err:
        CompressedStrategy(fedavg(), compressor="stc", denisty=0.1)
    assert str(err.value) == "unknown codec parameter(s) ['denisty']: 'denisty': did you mean 'density'?"
    with pytest.raises(TypeError) as err:
        CompressedStrategy(fedavg(), compressor="stc", blok_size=4, zzz=1)
    assert str(err.value) == ("unknown codec parameter(s) ['blok_size', 'zzz']: 'blok_size': did you mean "
                              "'block_size'?; 'zzz': no similar parameter")
    with pytest.raises(TypeError, match="Strategy"):
        CompressedStrategy(object())


@pytest.mark.parametrize("inner_name", ["fedavg", "fedadam", "dp"])
def test_wraps_flower_strategies_in_process(inner_name):
    """Real ClientApp + mod + wrapper around FedAvg, FedAdam and Flower's server-side DP."""
    from fedcomp.app.client_app import app as client_app
    from fedcomp.task.models import build_model

    common = dict(fraction_evaluate=0.0, min_available_nodes=3, min_train_nodes=3)
    inner = {
        "fedavg": lambda: FedAvg(**common),
        "fedadam": lambda: FedAdam(**common, eta=0.01, eta_l=0.05),
        "dp": lambda: DifferentialPrivacyServerSideFixedClipping(FedAvg(**common), noise_multiplier=0.0,
                                                                 clipping_norm=0.5, num_sampled_clients=3),
    }[inner_name]()
    grid = InProcessGrid(client_app, 3, {"num-server-rounds": 2})
    s = CompressedStrategy(inner, compressor="sign")
    start = ArrayRecord(build_model().state_dict())
    init = {k: v.numpy().copy() for k, v in start.items()}
    res = s.start(grid=grid, initial_arrays=start, num_rounds=2, train_config=ConfigRecord({"seed": 1}))
    assert s.history[2]["num-replies"] == 3 and s.history[2]["rejected-replies"] == 0
    moved = np.sqrt(sum(float(((res.arrays[k].numpy() - init[k]) ** 2).sum()) for k in init))
    assert moved > 0
    if inner_name == "dp":  # two rounds, each clipped mean update of norm <= 0.5
        assert moved <= 2 * 0.5 + 1e-5


def test_model_scope_payload_is_split_back_into_parameters():
    g, t = weights(0), weights(1)
    s = CompressedStrategy(fedavg(), compressor="topk", density=1.0)
    setup(s, g)
    arrays, _ = s.aggregate_train(1, [compressed_reply(g, t, 1, {"compressor": "topk", "density": 1.0})])
    m = s.history[1]  # the round's own figures (Flower gets the headline ones)
    for k in g:
        assert arrays[k].numpy().shape == g[k].shape
        assert np.allclose(arrays[k].numpy(), t[k], atol=1e-6)
    assert m["upload-bytes-topk"] == m["upload-bytes"]


def test_model_scope_payload_of_wrong_length_is_rejected():
    g, t = weights(0), weights(1)
    s = CompressedStrategy(fedavg(), compressor="topk")
    setup(s, g)
    reply = compressed_reply(g, t, 1, {"compressor": "topk"})
    data = fc.get_compressor("topk").compress(torch.ones(209))
    reply.content["arrays"][MODEL_KEY] = Array(dtype=PAYLOAD_DTYPE, shape=(len(data),), stype=PAYLOAD_STYPE, data=data)
    arrays, _ = s.aggregate_train(1, [reply])
    m = s.history[1]  # the round's own figures (Flower gets the headline ones)
    assert arrays is None and m["rejected-replies"] == 1


def test_simulated_round_time_is_slowest_client_compute_plus_transfer():
    g, t = weights(0), weights(1)
    s = CompressedStrategy(fedavg(), compressor="none")
    setup(s, g)
    r1 = compressed_reply(g, t, 1)
    r2 = compressed_reply(g, t, 2)
    for r, secs, up in ((r1, 2.0, 1.0), (r2, 0.5, 0.1)):
        m = dict(r.content["metrics"])
        m.update({"train-seconds": secs, "compress-seconds": 0.0, "uplink-mbps": up, "downlink-mbps": 10.0})
        r.content["metrics"] = MetricRecord(m)
    up_bytes = sum(len(a.data) for a in r1.content["arrays"].values())
    down = float(r1.content["metrics"].get("download-bytes", 0.0))  # a lean reply: the server counts its bytes
    _, _ = s.aggregate_train(1, [r1, r2])
    m = s.history[1]  # the round's own figures (Flower gets the headline ones)
    expect = max(2.0 + up_bytes * 8 / 1e6, 0.5 + up_bytes * 8 / 1e5) + down * 8 / 1e7
    assert m["round-seconds-simulated"] == pytest.approx(expect)


def test_hostile_client_metrics_do_not_break_the_round():
    g, t = weights(0), weights(1)
    s = CompressedStrategy(fedavg(), compressor="none")
    setup(s, g)
    r = compressed_reply(g, t, 1)
    m = dict(r.content["metrics"])
    m.update({"train-seconds": float("nan"), "uplink-mbps": -1.0, "compression-error": float("inf")})
    r.content["metrics"] = MetricRecord(m)
    arrays, out = s.aggregate_train(1, [r])
    assert arrays is not None and out["compression-error"] == 0.0
    assert 0 < s.history[1]["round-seconds-simulated"] < 10  # bad speed replaced by the 1 Mbps default


def test_selection_from_run_config_reaches_the_clients():
    from fedcomp.app.client_app import app as client_app
    from fedcomp.task.models import build_model

    cfg = AppConfig.from_run_config({"compressor": "topk", "selection": "tensor"})
    s = CompressedStrategy.from_codec_config(FedAvg(min_available_nodes=2), cfg.codec)
    assert s.codec.scope == "tensor"
    msgs = list(s.configure_train(1, ArrayRecord(build_model().state_dict()), ConfigRecord(),
                                  InProcessGrid(client_app, 2, {})))
    assert msgs[0].content["config"]["selection"] == "tensor"
