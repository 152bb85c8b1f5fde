"""``batchnorm-stats = "auto"`` (the default): BatchNorm's running statistics travel as their change, a
scaled sign per tensor with error feedback, both ways; the server knows every node's copy bit for bit,
a running variance is never negative on any side, and models without BatchNorm send the same bytes."""

import logging

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedcomp.client import compression_mod
from fedcomp.download.receiver import rebuild
from fedcomp.client.plan import plan_units
from fedcomp.compression import PayloadError, get_compressor
from fedcomp.config import CodecConfig
from fedcomp.download.layout import is_batchnorm_stat, stat_delta_key
from fedcomp.protocol.messages import MODEL_STATE_KEY
from fedcomp.statedict import FlatModel, to_record, to_state_dict
from fedcomp.strategies.aggregate import in_model_dtypes
from fedcomp.download.sender import Downstream
from tests.messages import make_ctx, make_msg
from tests.model_zoo import ZOO, trained_state, zoo
from tests.download.test_layout_batchnorm import STATS, _run

logging.getLogger("flwr").setLevel(logging.WARNING)


def _stats_of(rec: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: rec[k].numpy().copy() for k in STATS[:2]}


@pytest.mark.parametrize("codec", ["stc", "sign"])
def test_every_client_copy_equals_the_servers_record_of_it(codec):
    """Six rounds of lossy exchange both ways: what each node holds is what the server recorded, bit
    for bit; both are non-negative variances; and the change travelled as sign payloads, not fp32."""
    seen = []

    def check(strategy, grid, msgs, rnd):
        for m in msgs:
            node = m.metadata.dst_node_id
            rec = m.content["arrays"]
            if rnd > 1:  # a node with a known copy gets the change, never the exact statistics
                assert stat_delta_key("1.running_var") in rec and "1.running_var" not in rec
            held = _stats_of(grid.contexts[node].state[MODEL_STATE_KEY])
            ours = strategy.downstream.nodes.stats_pending[node]
            for k in STATS[:2]:
                assert np.array_equal(held[k], ours[k]), (rnd, node, k)
            assert held["1.running_var"].min() >= 0
            seen.append(rnd)

    arrays, _ = _run(codec, rounds=6, batchnorm_stats="auto", after_send=check)
    assert sorted(set(seen)) == list(range(1, 7)) and len(seen) == 18
    assert arrays["1.running_var"].numpy().min() >= 0


def test_the_download_of_the_statistics_is_their_sign_size():
    """Per message, ``auto`` sends 1 bit per entry and a scale per statistic instead of fp32: with a
    sign download (fixed-size payloads) the bytes differ by exactly that (16 entries, two tensors)."""
    def sent(stats):
        _, history = _run("sign", rounds=3, batchnorm_stats=stats, keep_bytes=True)
        return history

    exact, auto = sent("small"), sent("auto")
    saving = 2 * (len(get_compressor("none").compress(torch.zeros(16)))
                  - len(get_compressor("sign").compress(torch.zeros(16))))
    assert saving == 2 * (16 * 4 - 16 // 8 - 4)
    assert exact[0] == auto[0]  # round 1: every node is new (the statistics go exactly)
    for e, a in zip(exact[1:], auto[1:]):
        assert set(e) == set(a) and all(e[n] - a[n] == saving for n in e)


def test_the_upload_sends_each_statistic_as_sign_with_a_lossy_codec():
    shapes = {"0.weight": (4, 6), "1.running_mean": (4,), "1.running_var": (4,), "1.weight": (4,)}
    units = {k: c for k, _, c in plan_units(shapes, CodecConfig(compressor="stc"))}
    assert units == {"1.running_mean": "sign", "1.running_var": "sign", "fedcomp.model": "stc"}
    small = {k: c for k, _, c in plan_units(shapes, CodecConfig(compressor="stc", batchnorm_stats="small"))}
    assert small == {"1.running_mean": "none", "1.running_var": "none", "fedcomp.model": "stc"}
    # no error feedback, EF21, momentum correction or an uncompressed update: as "small"
    for cfg in (CodecConfig(compressor="stc", error_feedback=False), CodecConfig(compressor="none"),
                CodecConfig(compressor="stc", error_feedback="ef21"),
                CodecConfig(compressor="stc", momentum_correction=0.9)):
        assert {k: c for k, _, c in plan_units(shapes, cfg)}["1.running_var"] == "none", cfg


def test_the_server_clamps_an_aggregated_running_variance_at_zero():
    sd = {"bn.running_var": np.array([0.5, 0.01, 2.0], np.float32),
          "bn.running_mean": np.array([-1.0, 0, 1], np.float32)}
    model = FlatModel(sd, {k: "float32" for k in sd})
    agg = to_record({"bn.running_var": torch.tensor([0.4, -0.03, 1.0]), "bn.running_mean": torch.tensor([-2.0, 0, 1])})
    out = to_state_dict(in_model_dtypes(agg, model, {}))
    assert out["bn.running_var"].tolist() == [pytest.approx(0.4), 0.0, 1.0]
    assert out["bn.running_mean"].tolist() == [-2.0, 0.0, 1.0]  # a mean may be negative
    half = to_state_dict(in_model_dtypes(agg, model, {}, var_floor=0.5))  # "auto": at most halved per round
    assert half["bn.running_var"].tolist() == [pytest.approx(0.4), pytest.approx(0.005), 1.0]


@pytest.mark.parametrize("name", ZOO)
def test_zoo_downstream_copies_agree_over_rounds(name):
    """Every zoo model (BatchNorm in fp16 too, int/bool buffers, 0-d and empty parameters): five
    rounds of a downstream with ``auto`` statistics; the node's statistics equal the server's record."""
    sd = zoo()[name].state_dict()
    ds = Downstream(CodecConfig(compressor="stc"), "stc")
    ctx = make_ctx(node_id=5)
    weights, kinds = sd, []
    for rnd in range(1, 6):
        weights = trained_state(weights, rnd) if rnd > 1 else sd
        msg = make_msg(RecordDict({"arrays": to_record(weights), "config": ConfigRecord({"server-round": rnd})}),
                       dst=5)
        ds.prepare(rnd, to_record(weights), [msg])
        sent = set(msg.content["arrays"].keys())
        rebuilt = to_state_dict(rebuild(msg, ctx, "arrays", msg.content["arrays"], dict(msg.content["config"])))
        ds.received(5)
        stats = [k for k in sd if is_batchnorm_stat(k)]
        assert bool(stats) == (name in ("batchnorm1d", "batchnorm2d", "fp16"))
        for k in stats:
            assert rebuilt[k].dtype == sd[k].dtype
            assert torch.equal(rebuilt[k], torch.from_numpy(ds.nodes.stats[5][k].copy()).to(sd[k].dtype)), (rnd, k)
            if k.endswith("running_var"):
                assert float(rebuilt[k].float().min()) >= 0
            assert (stat_delta_key(k) in sent) == (rnd > 1 and ds.sent_kind[5] != "dense")
        kinds.append(ds.sent_kind[5])
    if stats:  # the statistics' change travelled in most rounds
        assert kinds[0] == "init" and sum(k != "dense" for k in kinds[1:]) >= 3, kinds


@pytest.mark.parametrize("name", [n for n in ZOO if not n.startswith("batchnorm") and n != "fp16"])
@pytest.mark.parametrize("codec", ["stc", "sign"])
def test_models_without_batchnorm_send_the_same_bytes(name, codec):
    """``auto`` changes nothing on a model without BatchNorm statistics: the same payloads, byte for byte."""
    sd = zoo()[name].state_dict()

    def reply(stats):
        config = {"server-round": 1, "seed": 3, **CodecConfig(compressor=codec, batchnorm_stats=stats).to_mapping()}
        msg = make_msg(RecordDict({"arrays": to_record(sd), "config": ConfigRecord(config)}), dst=10)

        def handler(m, c):
            content = RecordDict({"arrays": to_record(trained_state(sd, 0)),
                                  "metrics": MetricRecord({"num-examples": 1})})
            return Message(content=content, reply_to=m)

        out = compression_mod(msg, make_ctx(node_id=10), handler)
        assert not out.has_error()
        return {k: bytes(a.data) for k, a in out.content["arrays"].items()}

    auto = reply("auto")
    assert auto == reply("small") and len(auto) >= 1


def test_a_change_for_a_tensor_that_is_no_statistic_is_refused():
    sd = zoo()["batchnorm1d"].state_dict()
    ds = Downstream(CodecConfig(compressor="stc"), "stc")
    ctx = make_ctx(node_id=5)
    for rnd in (1, 2):
        msg = make_msg(RecordDict({"arrays": to_record(sd), "config": ConfigRecord({"server-round": rnd})}), dst=5)
        ds.prepare(rnd, to_record(sd), [msg])
        rec = msg.content["arrays"]
        if rnd == 2:
            rec[stat_delta_key("0.weight")] = rec[stat_delta_key("1.running_mean")]
            with pytest.raises(PayloadError, match="unknown keys"):
                rebuild(msg, ctx, "arrays", rec, dict(msg.content["config"]))
        else:
            rebuild(msg, ctx, "arrays", rec, dict(msg.content["config"]))
            ds.received(5)


def test_copies_agree_under_partial_participation_and_a_lost_reply():
    """5 nodes, 2 sampled a round, one reply lost in round 3: a node that skipped rounds gets the
    change since its own (older) copy, a node whose reply was lost is sent the statistics exactly
    again; every node that replied holds what the server recorded, bit for bit."""
    from flwr.serverapp.strategy import FedAvg

    from fedcomp.run.inprocess_grid import InProcessGrid
    from fedcomp.strategies import CompressedStrategy
    from tests.download.test_layout_batchnorm import _model, bn_app

    lost = {}

    def fault(rnd, pid):
        if rnd == 3 and not lost:
            lost[rnd] = pid
            return "reply lost"
        return None

    grid = InProcessGrid(bn_app, 5, {}, fault=fault)
    s = CompressedStrategy(FedAvg(fraction_train=0.4, min_train_nodes=2, min_available_nodes=5,
                                  fraction_evaluate=0.0), compressor="stc", downstream="stc",
                           batchnorm_stats="auto")
    arrays = ArrayRecord(_model().state_dict())
    forms, lost_node, resent = set(), [], []
    for rnd in range(1, 9):
        msgs = list(s.configure_train(rnd, arrays, ConfigRecord({"seed": 1}), grid))
        for m in msgs:
            node, rec = m.metadata.dst_node_id, m.content["arrays"]
            forms.add("change" if stat_delta_key("1.running_var") in rec else "exact")
            # a node the server knows a copy of gets the change, any other (the lost reply's) the values
            assert (stat_delta_key("1.running_var") in rec) == (node in s.downstream.nodes.stats), (rnd, node)
            if lost and node == lost_node[0]:
                resent.append(stat_delta_key("1.running_var") in rec)
        replies = grid.send_and_receive(msgs)
        arrays, _ = s.aggregate_train(rnd, replies)
        if rnd == 3:
            lost_node.extend(n for n, c in grid.contexts.items() if c.node_config["partition-id"] == lost[3])
        for m in msgs:
            node = m.metadata.dst_node_id
            if node in s.downstream.nodes.stats:
                held = _stats_of(grid.contexts[node].state[MODEL_STATE_KEY])
                for k in STATS[:2]:
                    assert np.array_equal(held[k], s.downstream.nodes.stats[node][k]), (rnd, node, k)
                assert held["1.running_var"].min() >= 0
        assert arrays["1.running_var"].numpy().min() > 0
    assert forms == {"change", "exact"} and lost
    assert resent and resent[0] is False  # sampled again after the lost reply: the values, exactly


def _second_message(model_sd: dict, init: str = "auto"):
    """Round 1 rebuilt and acknowledged on node 5; round 2's message (its ArrayRecord still to rebuild),
    the node's context and the bytes of its held copy."""
    ds = Downstream(CodecConfig(compressor="stc"), "stc", init=init)
    ctx = make_ctx(node_id=5)
    for rnd in (1, 2):
        w = trained_state(model_sd, rnd) if rnd > 1 else model_sd
        msg = make_msg(RecordDict({"arrays": to_record(w), "config": ConfigRecord({"server-round": rnd})}), dst=5)
        ds.prepare(rnd, to_record(w), [msg])
        if rnd == 1:
            rebuild(msg, ctx, "arrays", msg.content["arrays"], dict(msg.content["config"]))
            ds.received(5)
    held = {k: bytes(a.data) for k, a in ctx.state[MODEL_STATE_KEY].items()}
    return msg, ctx, held


def _sign(values):
    from fedcomp.protocol.messages import payload_array

    return payload_array(get_compressor("sign").compress(torch.tensor(values, dtype=torch.float32)))


@pytest.mark.parametrize("bad", ["wrong-shape", "truncated", "bad-scale"])
def test_a_malformed_statistic_change_is_refused_naming_it_and_the_copy_is_kept(bad):
    """A hostile server's change of ``1.running_var`` that does not decode: PayloadError naming the
    key (main: the codec's message alone, e.g. "truncated: sign bits need 1 bytes, 0 left"), held copy unchanged."""
    from fedcomp.protocol.messages import payload_array

    msg, ctx, held = _second_message(zoo()["batchnorm1d"].state_dict())
    rec, key = msg.content["arrays"], stat_delta_key("1.running_var")
    data = bytes(rec[key].data)
    rec[key] = {"wrong-shape": _sign([1.0] * 5),
                "truncated": payload_array(data[:-1]),
                "bad-scale": payload_array(data[:-5] + np.float32(-2.0).tobytes() + data[-1:])}[bad]
    with pytest.raises(PayloadError, match=r"^'fedcomp\.stat-delta/1\.running_var': "):
        rebuild(msg, ctx, "arrays", rec, dict(msg.content["config"]))
    assert {k: bytes(a.data) for k, a in ctx.state[MODEL_STATE_KEY].items()} == held


@pytest.mark.parametrize("init", ["dense", "auto"])
def test_a_statistic_change_without_a_held_copy_is_refused(init):
    """A change under ``fedcomp.stat-delta/`` in a dense (or init) message has no copy to apply to:
    refused naming it, nothing kept (main: a dense message kept it as a model tensor named
    'fedcomp.stat-delta/1.running_var' in the node's copy and in the weights handed to training)."""
    sd = zoo()["batchnorm1d"].state_dict()
    ds = Downstream(CodecConfig(compressor="stc"), "stc", init=init)
    ctx = make_ctx(node_id=5)
    msg = make_msg(RecordDict({"arrays": to_record(sd), "config": ConfigRecord({"server-round": 1})}), dst=5)
    ds.prepare(1, to_record(sd), [msg])
    assert ds.sent_kind[5] == ("dense" if init == "dense" else "init")
    rec = msg.content["arrays"]
    rec[stat_delta_key("1.running_var")] = _sign([1.0] * 4)
    with pytest.raises(PayloadError, match=r"changes \['fedcomp\.stat-delta/1\.running_var'\] but names no held copy"):
        rebuild(msg, ctx, "arrays", rec, dict(msg.content["config"]))
    assert MODEL_STATE_KEY not in ctx.state


def test_a_negative_running_variance_sent_exactly_is_refused_naming_it():
    """A node the server knows no statistics of gets them exactly; a fedcomp server never sends a
    negative running variance (its aggregate is floored), so one is refused naming the key and the
    held copy is kept (main: applied; BatchNorm's eval output then NaN where var + eps < 0)."""
    from fedcomp.protocol.messages import payload_array

    msg, ctx, held = _second_message(zoo()["batchnorm1d"].state_dict())
    rec = msg.content["arrays"]
    del rec[stat_delta_key("1.running_var")]  # the change form is floored: send the exact form
    rec["1.running_var"] = payload_array(get_compressor("none").compress(torch.tensor([1.0, -0.5, 1.0, 1.0])))
    with pytest.raises(PayloadError, match=(r"^downloaded model: '1\.running_var' is a running variance with "
                                            r"negative entries \(min -0\.5\)")):
        rebuild(msg, ctx, "arrays", rec, dict(msg.content["config"]))
    assert {k: bytes(a.data) for k, a in ctx.state[MODEL_STATE_KEY].items()} == held
    rec["1.running_var"] = payload_array(get_compressor("none").compress(torch.tensor([1.0, 0.0, 2.0, 1.0])))
    out = rebuild(msg, ctx, "arrays", rec, dict(msg.content["config"]))  # zero is a variance
    assert out["1.running_var"].numpy().tolist() == [1.0, 0.0, 2.0, 1.0]


def _stats_copy(n: int) -> FlatModel:
    """A node's statistics copy: running mean and variance of ``n`` channels and the batch counter."""
    return FlatModel({"1.running_mean": np.zeros(n, np.float32), "1.running_var": np.ones(n, np.float32),
                      "1.num_batches_tracked": np.array(3, np.int64)},
                     {"1.running_mean": "float32", "1.running_var": "float32", "1.num_batches_tracked": "int64"})


def test_the_copy_budget_counts_the_nodes_statistics_copies():
    """Many nodes at the latest version each hold a statistics copy: before, those copies were not counted
    and grew with the number of nodes past any budget. Now they count (bytes in vectors of the compressed
    part) and, past the budget, the least recently replying node lets go of its statistics copy alone: it
    stays known (no dense first contact again) and is sent the exact statistics next time."""
    from fedcomp.download.node_copies import NodeCopies

    nodes = NodeCopies(max_copies=4)
    nodes.add_version(np.zeros(1000, np.float32))
    stat_vectors = (2 * 250 * 4 + 8) / (4 * 1000)  # one copy: 250 channels x 2 float32 + an int64, per 4,000 B
    for node in range(1, 41):
        nodes.send(node, nodes.version)
        nodes.send_stats(node, _stats_copy(250))
        nodes.commit(node, rebuild=None)
        assert nodes.copies() <= 4 + 1e-12
    assert nodes.copies() == pytest.approx(1 + len(nodes.stats) * stat_vectors)
    assert len(nodes.stats) == int(3 / stat_vectors) == 5  # the budget's 3 spare vectors hold 5 copies
    assert sorted(nodes.stats) == list(range(36, 41))  # the most recently replying ones
    assert sorted(nodes.node_version) == list(range(1, 41))  # nobody forgotten: their models cost nothing
    # once a newer version exists, holding version 1 costs a vector: past the budget the statistics copies
    # go first, alone (least recently replying first; their nodes stay known), and nodes are forgotten
    # only when none is left; version 1 goes only with the last of the nodes that hold it
    nodes.add_version(np.ones(1000, np.float32))
    # versions 1 and 2 plus 5 statistics copies (2.51 vectors) = 4.51; dropping 36's, 37's and 38's
    # statistics gets it to 3.004 <= 3.5. (Before: nodes 1-38 forgotten whole, least recently replying
    # first, though 1-35 freed nothing while others still held version 1.)
    nodes.evict(3.5)
    assert sorted(nodes.stats) == [39, 40]
    assert sorted(nodes.node_version) == list(range(1, 41))  # nobody forgotten
    assert nodes.copies() == pytest.approx(2 + 2 * stat_vectors)
    nodes.evict(2)  # 39's and 40's statistics go; versions 1 and 2 remain, 2 copies
    assert sorted(nodes.node_version) == list(range(1, 41)) and nodes.stats == {} and nodes.copies() == 2
    nodes.evict(1)  # version 1 goes with the last of its 40 holders
    assert nodes.node_version == {} and list(nodes.versions) == [2] and nodes.copies() == 1


def test_the_librarys_default_is_exact_statistics_and_the_apps_stays_auto():
    """``CompressedStrategy`` without ``batchnorm_stats`` sends BatchNorm's statistics exactly (``"small"``,
    told to the clients in the train config); ``"auto"`` when asked for, under either name; the reference
    app builds its strategy from the run config, whose default stays ``"auto"``."""
    from flwr.serverapp.strategy import FedAvg

    from fedcomp.strategies import CompressedStrategy
    from fedcomp.strategies.codec_round import codec_entries

    library = CompressedStrategy(FedAvg(), compressor="sign", downstream="sign")
    assert library.codec.batchnorm_stats == "small" and library.codec.batchnorm_stats_codec() == "none"
    assert codec_entries(library.codec, 1)["batchnorm-stats"] == "small"
    assert library.downstream.codec.batchnorm_stats == "small"  # the download sends them exactly too
    for asked in ({"batchnorm_stats": "auto"}, {"batchnorm-stats": "auto"}):
        assert CompressedStrategy(FedAvg(), compressor="sign", **asked).codec.batchnorm_stats == "auto"
    app = CompressedStrategy.from_codec_config(FedAvg(), CodecConfig(compressor="sign"))
    assert CodecConfig().batchnorm_stats == "auto" and app.codec.batchnorm_stats == "auto"
