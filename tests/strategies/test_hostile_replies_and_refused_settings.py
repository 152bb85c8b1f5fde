"""Hostile numbers, one node one vote, refused
configurations, local DP's integer tensors, a mixed fleet, settings changed after wrapping."""

import logging

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord
from flwr.common import ndarrays_to_parameters
from flwr.server.strategy import FedAvgM as LegacyFedAvgM
from flwr.serverapp.strategy import FedAvgM

from fedcomp.client import compression_mod
from fedcomp.app.config import AppConfig
from fedcomp.config import CodecConfig
from fedcomp.privacy import LocalDP
from fedcomp.app.server_app import concern_options
from fedcomp.run.inprocess_grid import InProcessGrid
from fedcomp.strategies import Admission, CompressedStrategy, Privacy
from fedcomp.strategies.legacy_strategy import LegacyCompressedStrategy
from tests.messages import make_ctx, reply_with, train_msg, weights
from tests.strategies.legacy_helpers import LinRegClient, NumPyProxy, init_weights

from .helpers import compressed_reply, fedavg, setup

logging.getLogger("flwr").setLevel(logging.WARNING)


# -- Finite but huge client metrics ------------------------------------------------------

def test_huge_client_metrics_neither_crash_the_round_nor_become_infinite():
    g, t = weights(0), weights(1)
    s = CompressedStrategy(fedavg(), compressor="none")
    setup(s, g)
    replies = [compressed_reply(g, t, 1), compressed_reply(g, t, 2)]
    for r in replies:  # what a hostile client reports, after the mod
        r.content["metrics"]["compression-error"] = 1.7e308
        r.content["metrics"]["residual-norm"] = -1.7e308
        r.content["metrics"]["train-loss"] = 1.7e308
    arrays, flower = s.aggregate_train(1, replies)
    m = s.history[1]  # the round's own figures (Flower gets the headline ones)
    assert arrays is not None and m["num-replies"] == 2  # raised OverflowError (fsum) before
    assert m["compression-error"] == 1e100 and m["residual-norm"] == -1e100
    assert flower["compression-error"] == 1e100
    assert np.isfinite(flower["train-loss"]) and flower["train-loss"] == pytest.approx(1e100)


def _legacy_results(strategy, rnd=1, n=3):
    from flwr.server import SimpleClientManager

    from fedcomp.client.numpy_client import CompressedNumPyClient

    cm = SimpleClientManager()
    for i in range(n):
        cm.register(NumPyProxy(str(i), CompressedNumPyClient(LinRegClient(i))))
    results = []
    for proxy, ins in strategy.configure_fit(rnd, ndarrays_to_parameters(init_weights()), cm):
        results.append((proxy, proxy.fit(ins, None, rnd)))
    return results


def _legacy(**kw):
    from flwr.server.strategy import FedAvg as LegacyFedAvg

    return LegacyCompressedStrategy(LegacyFedAvg(min_fit_clients=3, min_available_clients=3, fraction_evaluate=0.0),
                                    compressor="none", **kw)


def test_huge_client_metrics_do_not_crash_the_legacy_wrapper():
    s = _legacy()
    results = _legacy_results(s)
    for _, res in results:
        res.metrics["compression-error"] = 1.7e308
    params, m = s.aggregate_fit(1, results, [])
    assert params is not None and m["compression-error"] == 1e100


# -- One node, one vote ----------------------------------------------------------------

def test_a_nodes_second_reply_is_refused_and_counted_as_rejected():
    g, t1, t2 = weights(0), weights(1), weights(2)
    s = CompressedStrategy(fedavg(), compressor="none")
    setup(s, g)
    once, _ = s.aggregate_train(1, [compressed_reply(g, t1, 1, n=10), compressed_reply(g, t2, 2, n=10)])
    setup(s, g)
    arrays, m = s.aggregate_train(1, [compressed_reply(g, t1, 1, n=10), compressed_reply(g, t2, 2, n=10),
                                      compressed_reply(g, t2, 2, n=10)])
    m = s.history[1]
    assert m["rejected-replies"] == 1 and m["num-replies"] == 2
    for k in g:  # node 2 counted once: the plain mean, not (t1 + 2 t2) / 3
        np.testing.assert_array_equal(arrays[k].numpy(), once[k].numpy())


def test_a_reply_from_a_node_that_was_not_asked_is_refused():
    from fedcomp.app.client_app import app as client_app
    from fedcomp.task.models import build_model

    grid = InProcessGrid(client_app, 2, {})
    s = CompressedStrategy(fedavg(), compressor="none")
    sd = {k: v.numpy() for k, v in build_model().state_dict().items()}
    msgs = list(s.configure_train(1, ArrayRecord(build_model().state_dict()), ConfigRecord(), grid))
    asked = sorted(m.metadata.dst_node_id for m in msgs)
    assert asked == [1000, 1001]
    moved = {k: (v + 0.01 if v.dtype.kind == "f" else v) for k, v in sd.items()}
    replies = [compressed_reply(sd, moved, node) for node in (*asked, 4242)]
    _, _ = s.aggregate_train(1, replies)
    m = s.history[1]  # the round's own figures (Flower gets the headline ones)
    assert m["num-replies"] == 2 and m["rejected-replies"] == 1


def _tiny_grid(num_nodes=2):
    """An in-process grid whose nodes run ``compression_mod`` around a handler that adds
    0.01 * (node - 999) * round to every weight."""
    from flwr.clientapp import ClientApp

    app = ClientApp(mods=[compression_mod])

    @app.train()
    def train(msg, ctx):
        step = 0.01 * (ctx.node_id - 999) * msg.content["config"]["server-round"]
        moved = {k: v.numpy() + step for k, v in msg.content["arrays"].items()}
        return reply_with(msg, moved, n=10)

    return InProcessGrid(app, num_nodes, {})


def _sent_round(s, grid, rnd, g):
    msgs = list(s.configure_train(rnd, ArrayRecord({k: _np_array(v) for k, v in g.items()}), ConfigRecord(), grid))
    return msgs, list(grid.send_and_receive(msgs))


def _np_array(v):
    from flwr.app import Array

    return Array(np.array(v, copy=True))


@pytest.mark.parametrize("case", ["instead of its reply", "before its reply", "after its reply"])
def test_a_stale_reply_from_an_earlier_round_is_refused_and_counted_as_rejected(case, caplog):
    """Node 1000's round-1 reply delivered in round 2 (in place of its lost round-2 reply, or next to it)
    is refused with its reason and counted in rejected-replies; round 2 counts only round-2 replies."""
    g = weights(0)
    grid = _tiny_grid()
    s = CompressedStrategy(fedavg(), compressor="none")
    _, round1 = _sent_round(s, grid, 1, g)
    s.aggregate_train(1, round1)
    msgs, round2 = _sent_round(s, grid, 2, g)
    stale = next(r for r in round1 if r.metadata.src_node_id == 1000)
    fresh = next(r for r in round2 if r.metadata.src_node_id == 1000)
    other = next(r for r in round2 if r.metadata.src_node_id == 1001)
    assert stale.metadata.reply_to_message_id not in {m.metadata.message_id for m in msgs}
    replies = {"instead of its reply": [stale, other], "before its reply": [stale, fresh, other],
               "after its reply": [fresh, other, stale]}[case]
    with caplog.at_level(logging.WARNING, logger="flwr"):
        arrays, _ = s.aggregate_train(2, replies)
    m = s.history[2]
    counted = [other] if case == "instead of its reply" else [fresh, other]
    assert m["num-replies"] == len(counted) and m["rejected-replies"] == 1
    assert [st["node"] for st in s.client_history[2]] == [r.metadata.src_node_id for r in counted]
    for k in g:  # the mean of the round-2 updates counted: 0.02 * (node - 999) each
        want = g[k] + np.mean([0.02 * (r.metadata.src_node_id - 999) for r in counted], dtype=np.float32)
        np.testing.assert_allclose(arrays[k].numpy(), want, rtol=0, atol=1e-6)
    why = [r.getMessage() for r in caplog.records if "rejected reply" in r.getMessage()]
    assert why == [(f"round 2: rejected reply from node 1000: it answers message "
                    f"{stale.metadata.reply_to_message_id!r}, which this round did not send "
                    "(a stale reply from an earlier round, or forged)")]


def test_a_reply_naming_another_nodes_message_is_refused():
    """Node 1000's reply relabelled as the answer to the message sent to node 1001 (what Flower's SuperLink
    would never store) is refused; node 1001's own reply counts once."""
    g = weights(0)
    grid = _tiny_grid()
    s = CompressedStrategy(fedavg(), compressor="none")
    msgs, replies = _sent_round(s, grid, 1, g)
    by_node = {r.metadata.src_node_id: r for r in replies}
    to_1001 = next(m.metadata.message_id for m in msgs if m.metadata.dst_node_id == 1001)
    md = by_node[1000].metadata
    md.__dict__["_reply_to_message_id"] = to_1001
    s.aggregate_train(1, [by_node[1000], by_node[1001]])
    m = s.history[1]
    assert m["num-replies"] == 1 and m["rejected-replies"] == 1
    assert [st["node"] for st in s.client_history[1]] == [1001]


def test_the_legacy_wrapper_counts_a_duplicated_fit_result_once():
    s = _legacy()
    results = _legacy_results(s)
    ref, _ = s.aggregate_fit(1, list(results), [])
    s2 = _legacy()
    results2 = _legacy_results(s2)
    params, m = s2.aggregate_fit(1, results2 + [results2[0]], [])
    assert m["rejected-replies"] == 1 and m["num-replies"] == 3
    from flwr.common import parameters_to_ndarrays

    for a, b in zip(parameters_to_ndarrays(params), parameters_to_ndarrays(ref)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)  # counted twice, client 0 moved the mean by > 1e-3


# -- Configurations refused at start-up -----------------------------------------

@pytest.mark.parametrize("codec", ["sign", "powersgd", "int8", "none"])
def test_momentum_correction_with_a_codec_that_sends_every_entry_is_refused(codec):
    with pytest.raises(ValueError, match=f"'momentum-correction' works with the sparsifying codecs.*'{codec}'"):
        CodecConfig.from_mapping({"compressor": codec, "momentum-correction": 0.9})


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, 0.0, "1"])
def test_max_epsilon_must_be_a_finite_positive_number(value):
    with pytest.raises(ValueError, match="max_epsilon .* must be a finite number > 0"):
        CompressedStrategy(fedavg(), compressor="none", privacy=Privacy(max_epsilon=value))


@pytest.mark.parametrize("value", [0, float("inf"), float("nan"), 2.5, -3, True])
def test_max_num_examples_must_be_an_integer_of_at_least_1(value):
    with pytest.raises(ValueError, match="max_num_examples must be an integer >= 1"):
        CompressedStrategy(fedavg(), compressor="none", admission=Admission(max_num_examples=value))
    with pytest.raises(ValueError, match="max_num_examples must be an integer >= 1"):
        _legacy(max_num_examples=value)


@pytest.mark.parametrize("dp", ["client-level", "local"])
def test_a_noise_multiplier_the_accountant_cannot_handle_is_refused_at_start_up(dp):
    cfg = AppConfig.from_run_config({"dp": dp, "noise-multiplier": 1e-200})
    with pytest.raises(ValueError, match="'noise-multiplier' = 1e-200 is too small for the RDP accountant"):
        concern_options(cfg)
    concern_options(AppConfig.from_run_config({"dp": dp, "noise-multiplier": 1e-20}))  # computable: accepted


# -- The client's own privacy setting ---------------------------------------------------

@pytest.mark.parametrize("value,hint", [("Local", "did you mean 'local'"), ("locl", "did you mean 'local'"),
                                        ("yes", "")])
def test_an_unknown_value_of_the_clients_own_dp_setting_is_refused(value, hint):
    g, t = weights(0), weights(1)
    msg = train_msg(g, {"compressor": "none"}, dst=5)
    trained = []
    with pytest.raises(ValueError, match=f"node config 'dp' must be one of .*got '{value}'.*{hint}"):
        compression_mod(msg, make_ctx(node_config={"dp": value}, node_id=5),
                        lambda m, c: trained.append(1) or reply_with(m, t))
    assert trained == []  # refused before training


# -- Local DP keeps the server's integer and bool tensors -------------------------------

def test_under_local_dp_the_server_keeps_its_own_integer_and_bool_values():
    g = {"w": np.zeros(4, np.float32), "cnt": np.array(5, np.int64), "mask": np.array([True, False])}
    s = CompressedStrategy(fedavg(), compressor="none", privacy=Privacy(local_dp=LocalDP(1.0, 0.0)))
    setup(s, g)
    # A client that ignores local DP and sends its exact counters anyway (as a plain compression_mod would).
    cheat = compressed_reply(g, {"w": np.ones(4, np.float32), "cnt": np.array(105, np.int64),
                                 "mask": np.array([False, True])}, 1, codec={"compressor": "none"})
    assert "cnt" in cheat.content["arrays"]
    arrays, _ = s.aggregate_train(1, [cheat])
    m = s.history[1]  # the round's own figures (Flower gets the headline ones)
    assert m["num-replies"] == 1
    assert int(arrays["cnt"].numpy()) == 5 and arrays["mask"].numpy().tolist() == [True, False]  # was 105


# -- A mixed fleet -----------------------------------------------------------------------

def _dense_reply(global_w, trained_w, node, n=10):
    msg = train_msg(global_w, {"compressor": "stc"}, dst=node)
    return reply_with(msg, trained_w, n=n)  # no compression_mod: plain weights


def test_dense_replies_are_counted_as_uncompressed_updates_next_to_compressed_ones():
    g, t1, t2 = weights(0), weights(1), weights(2)
    s = CompressedStrategy(fedavg(), compressor="none")
    setup(s, g)
    dense = _dense_reply(g, t2, 2, n=30)
    dense_bytes = sum(len(a.data) for a in dense.content["arrays"].values())
    arrays, _ = s.aggregate_train(1, [compressed_reply(g, t1, 1, n=10), dense])
    m = s.history[1]  # the round's own figures (Flower gets the headline ones)
    assert m["num-replies"] == 2 and m["rejected-replies"] == 0  # rejected before
    assert m["upload-bytes-dense"] == float(dense_bytes) == 4.0 * 210 + 2 * 128  # two .npy headers
    for k in g:
        np.testing.assert_allclose(arrays[k].numpy(), (10 * t1[k] + 30 * t2[k]) / 40, atol=1e-6)


def test_a_fleet_of_only_dense_clients_trains_with_the_models_dtypes():
    g = {"w": np.zeros(3, np.float32), "cnt": np.array(2, np.int64)}
    s = CompressedStrategy(fedavg(), compressor="stc", density=0.5, downstream="none")  # plain clients
    setup(s, g)
    arrays, m = s.aggregate_train(1, [_dense_reply(g, {"w": np.ones(3, np.float32), "cnt": np.array(6, np.int64)}, 1),
                                      _dense_reply(g, {"w": np.ones(3, np.float32), "cnt": np.array(4, np.int64)}, 2)])
    assert m["num-replies"] == 2
    assert arrays["w"].numpy().tolist() == [1.0, 1.0, 1.0] and int(arrays["cnt"].numpy()) == 5


@pytest.mark.parametrize("bad", ["dtype", "shape", "key", "nan"])
def test_a_dense_reply_is_validated_like_a_payload(bad, caplog):
    g, t = weights(0), weights(1)
    t = {k: v.copy() for k, v in t.items()}
    if bad == "dtype":
        t["w"] = t["w"].astype(np.float64)
    elif bad == "shape":
        t["w"] = t["w"].reshape(10, 20)
    elif bad == "key":
        t["zzz"] = t.pop("w")
    else:
        t["w"][3, 3] = np.nan
    s = CompressedStrategy(fedavg(), compressor="none")
    setup(s, g)
    arrays, _ = s.aggregate_train(1, [_dense_reply(g, t, 1)])
    m = s.history[1]  # the round's own figures (Flower gets the headline ones)
    assert arrays is None and m["rejected-replies"] == 1


def test_the_operator_can_require_compression():
    g, t = weights(0), weights(1)
    s = CompressedStrategy(fedavg(), compressor="none", admission=Admission(require_compression=True))
    setup(s, g)
    arrays, _ = s.aggregate_train(1, [_dense_reply(g, t, 1)])
    m = s.history[1]  # the round's own figures (Flower gets the headline ones)
    assert arrays is None and m["rejected-replies"] == 1
    cfg = AppConfig.from_run_config({"require-compression": True})
    assert concern_options(cfg)["admission"].require_compression is True
    assert AppConfig.from_run_config({}).require_compression is False


# -- Settings changed after wrapping --------------------------------------------------

def test_settings_of_the_inner_strategy_reach_it_through_the_wrapper():
    inner = FedAvgM(server_learning_rate=1.0, server_momentum=0.0)
    s = CompressedStrategy(inner, compressor="none")
    s.server_learning_rate = 0.25
    s.server_momentum = 0.5
    assert (inner.server_learning_rate, inner.server_momentum) == (0.25, 0.5)  # landed on the wrapper before
    assert s.server_learning_rate == 0.25 and "server_learning_rate" not in vars(s)


def test_a_setting_neither_the_wrapper_nor_the_inner_strategy_has_is_refused_naming_inner():
    s = CompressedStrategy(FedAvgM(), compressor="none")
    with pytest.raises(AttributeError, match=r"no setting 'server_learnig_rate'.*FedAvgM.*\.inner"):
        s.server_learnig_rate = 0.5
    s.admission.max_num_examples = 100  # the wrapper's own settings (its concerns') stay its own
    assert s.max_num_examples == 100 and not hasattr(s.inner, "max_num_examples")


def test_the_legacy_wrapper_forwards_to_its_strategy():
    inner = LegacyFedAvgM(server_learning_rate=1.0, server_momentum=0.0)
    s = LegacyCompressedStrategy(inner, compressor="none")
    s.server_momentum = 0.9
    assert inner.server_momentum == 0.9 and s.server_momentum == 0.9
    with pytest.raises(AttributeError, match=r"\.strategy"):
        s.server_momentun = 0.9
