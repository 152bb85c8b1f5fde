"""Flower's client-mod contracts, restated with ``compression_mod`` stacked in the chain.

Flower 1.42 tests its mods one at a time: ``make_ffn`` calls mods in order and lets any mod answer
by itself (``flwr/client/mod/utils_test.py``); the clipping mods and ``LocalDpMod`` clip the update
``reply - received`` and leave a 0-d array as it is (``flwr/clientapp/mod/dp_mods_test.py``);
``message_size_mod`` counts every record's bytes (``comms_mods.py``); ``secaggplus_mod`` checks its
stage transitions and configs (``secure_aggregation/secaggplus_mod_test.py``). The tests below
check each of these with ``compression_mod`` outermost (and inside where a mod allows it).
Flower's DP mods outside ``compression_mod`` cannot hold: they need dense weights in the reply.
"""

import logging
import re

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.client.mod import make_ffn, secaggplus_mod
from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import LocalDpMod, adaptiveclipping_mod, arrays_size_mod, fixedclipping_mod, message_size_mod
from flwr.common.constant import ErrorCode
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, RECORD_KEY_STATE, Key, Stage
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.differential_privacy import KEY_NORM_BIT

import fedcomp.compression as fc
from fedcomp.client import CompositionError, compression_mod
from fedcomp.config import CodecConfig
from fedcomp.protocol.messages import PAYLOAD_STYPE
from fedcomp.run.inprocess_grid import InProcessGrid
from fedcomp.secagg.client import secagg_mod
from fedcomp.secagg.guard import UnsafeRequest
from fedcomp.statedict import FlatModel
from fedcomp.strategies import CompressedStrategy
from fedcomp.strategies.codec_round import add_codec
from tests.messages import make_ctx, make_msg, reply_with, train_msg

EXACT = {"compressor": "none", "error-feedback": False}  # payloads decode to the update bit for bit


def _decoded(reply: Message) -> dict[str, np.ndarray]:
    return {k: fc.decompress(a.data).numpy() for k, a in reply.content["arrays"].items()}


# -- make_ffn: order of mods, a mod that answers by itself ------------------------------------------


def _recording_mod(name: str, trace: list):
    """A mod that notes its name on the way in and out, adds an empty ConfigRecord named after itself
    to the message and to the reply, and counts its calls in ``context.state``."""

    def mod(msg, ctx, call_next):
        trace.append(name)
        msg.content[name] = ConfigRecord()
        _count(ctx)
        reply = call_next(msg, ctx)
        trace.append(name)
        _count(ctx)
        reply.content[name] = ConfigRecord()
        return reply

    return mod


def _count(ctx) -> None:
    n = ctx.state["calls"]["n"] if "calls" in ctx.state else 0
    ctx.state["calls"] = MetricRecord({"n": n + 1})


def _no_array_app(trace: list):
    def app(msg, ctx):
        trace.append("app")
        msg.content["app"] = ConfigRecord()
        return Message(RecordDict({"app": ConfigRecord()}), reply_to=msg)

    return app


@pytest.mark.parametrize("position", [0, 3, 6])
def test_mods_run_in_order_with_compression_mod_anywhere_in_the_chain(position):
    """A train message without an ArrayRecord is not ours: every other mod and the app run, in order."""
    trace, names = [], [f"mod{i}" for i in range(6)]
    mods = [_recording_mod(n, trace) for n in names]
    mods.insert(position, compression_mod)
    msg, ctx = make_msg(RecordDict()), make_ctx()
    reply = make_ffn(_no_array_app(trace), mods)(msg, ctx)
    assert trace == names + ["app"] + names[::-1]
    assert list(msg.content.config_records) == names + ["app"]
    assert list(reply.content.config_records) == ["app"] + names[::-1]
    assert ctx.state["calls"]["n"] == 2 * len(names)


@pytest.mark.parametrize("position", [0, 2, 4])
def test_a_train_message_still_compresses_with_other_mods_adding_config_records(position):
    """Mods around compression_mod add ConfigRecords of their own: the train config is the one that
    carries the codec keys, and the reply still leaves as payloads of the update."""
    g, t = {"w": np.zeros(6, np.float32)}, {"w": np.arange(6, dtype=np.float32)}
    trace, names = [], [f"mod{i}" for i in range(4)]
    mods = [_recording_mod(n, trace) for n in names]
    mods.insert(position, compression_mod)
    reply = make_ffn(lambda m, c: reply_with(m, t), mods)(train_msg(g, EXACT), make_ctx())
    assert trace == names + names[::-1]
    assert reply.content["arrays"]["w"].stype == PAYLOAD_STYPE
    assert np.array_equal(_decoded(reply)["w"], t["w"])


def test_train_message_with_two_train_configs_is_refused_before_training():
    msg = train_msg({"w": np.zeros(3, np.float32)}, EXACT)
    msg.content["other"] = ConfigRecord({"compressor": "sign"})
    called = []
    with pytest.raises(CompositionError, match="'config', 'other'"):
        compression_mod(msg, make_ctx(), lambda m, c: called.append(m))
    assert called == []


def test_a_mod_inside_compression_mod_may_answer_by_itself():
    """A filtering mod answers without calling the app; compression_mod hands its answer on as it is,
    with or without weights in the message."""
    trace = []

    def filter_mod(msg, ctx, call_next):
        trace.append("filter")
        return Message(RecordDict({"filter": ConfigRecord({"why": "filtered"})}), reply_to=msg)

    app = make_ffn(_no_array_app(trace), [compression_mod, filter_mod])
    for msg in (make_msg(RecordDict()), train_msg({"w": np.zeros(3, np.float32)}, EXACT)):
        reply = app(msg, make_ctx())
        assert list(reply.content.keys()) == ["filter"] and reply.content["filter"]["why"] == "filtered"
    assert trace == ["filter", "filter"]


def test_a_train_message_with_two_array_records_goes_through_untouched():
    content = RecordDict({"a": ArrayRecord({"w": Array(np.zeros(3))}), "b": ArrayRecord({"w": Array(np.ones(3))})})
    msg = make_msg(content)
    sentinel = Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)
    seen = []
    assert compression_mod(msg, make_ctx(), lambda m, c: seen.append(m) or sentinel) is sentinel
    assert seen == [msg]


# -- Flower's clipping mods and LocalDpMod inside compression_mod -------------------------------------


def _flower_alone(mod, g: dict, t: dict, config: dict) -> dict[str, np.ndarray]:
    """What Flower's ``mod`` alone makes of the reply ``t`` to ``g``: its reply's arrays."""
    reply = mod(train_msg(g, config), make_ctx(), lambda m, c: reply_with(m, t))
    return {k: a.numpy() for k, a in reply.content["arrays"].items()}


def _stacked(mod, g: dict, t: dict, config: dict) -> Message:
    return make_ffn(lambda m, c: reply_with(m, t), [compression_mod, mod])(train_msg(g, config), make_ctx())


def _model(scalar: float = 2.0) -> tuple[dict, dict]:
    """A float32 vector and a 0-d float32 parameter; the update has norm 7 (vector 3*sqrt(5), scalar 2)."""
    g = {"v": np.zeros(5, np.float32), "s": np.array(0.0, np.float32)}
    return g, {"v": np.full(5, 3.0, np.float32), "s": np.array(scalar, np.float32)}


@pytest.mark.parametrize("mod", [fixedclipping_mod, adaptiveclipping_mod], ids=["fixed", "adaptive"])
def test_clipping_mod_inside_compression_mod_sends_exactly_the_clipped_update(mod):
    g, t = {"w": np.zeros((4, 5), np.float32)}, {"w": np.full((4, 5), 0.5, np.float32)}  # norm sqrt(5)
    cfg = {**EXACT, "clipping_norm": 1.0}
    reply = _stacked(mod, g, t, cfg)
    expected = _flower_alone(mod, g, t, cfg)
    sent = _decoded(reply)["w"]
    assert np.array_equal(sent, expected["w"] - g["w"])
    assert float(np.linalg.norm(sent)) == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("mod", [fixedclipping_mod, adaptiveclipping_mod], ids=["fixed", "adaptive"])
def test_zero_d_parameter_left_unclipped_by_flower_is_accepted(mod):
    """Flower clips the other tensors by clip/7 and leaves the 0-d one at 2.0; that is not our mod
    sitting outside Flower's (the check looks at the tensors Flower clips). What is sent is Flower's
    update scaled into the bound as a whole (fedcomp.client.clip_bound), the 0-d parameter included."""
    g, t = _model()
    cfg = {**EXACT, "clipping_norm": 1.0}
    reply = _stacked(mod, g, t, cfg)
    sent = _decoded(reply)
    flower = _flower_alone(mod, g, t, cfg)
    assert sent["s"].shape == ()
    assert float(np.linalg.norm(flower["v"])) == pytest.approx(3 * 5**0.5 / 7, rel=1e-6) and float(flower["s"]) == 2.0
    total = float(np.sqrt(np.sum(sent["v"].astype(np.float64) ** 2) + float(sent["s"]) ** 2))
    assert 1.0 - 1e-3 <= total <= 1.0 + 1e-6
    factor = float(sent["s"]) / 2.0  # one factor for every tensor: the direction of Flower's update kept
    np.testing.assert_allclose(sent["v"], flower["v"] * factor, rtol=1e-6)


def test_scalar_only_model_under_fixed_clipping():
    """Flower's own case: one float64 0-d weight, 0 -> 2, clipping norm 1: Flower alone sends 2 (its
    mod clips no 0-d array); stacked in compression_mod no error is raised, and the client's bound
    check sends it within the clipping norm (1 - 2**-22: the first rescaling's margin)."""
    g, t = {"w": np.array(0.0)}, {"w": np.array(2.0)}
    assert float(_flower_alone(fixedclipping_mod, g, t, {**EXACT, "clipping_norm": 1.0})["w"]) == 2.0
    reply = _stacked(fixedclipping_mod, g, t, {**EXACT, "clipping_norm": 1.0})
    assert float(_decoded(reply)["w"]) == pytest.approx(1.0 - 2.0**-22, rel=1e-9)


@pytest.mark.parametrize("mod", [fixedclipping_mod, adaptiveclipping_mod], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("clip", [1.0, 100.0], ids=["above the bound", "within the bound"])
def test_codec_none_under_flower_clipping_is_flowers_update_within_a_bound(mod, clip):
    """Codec ``none``: what the server decodes and aggregates against Flower's own clipped reply. Flower
    scales in float32 and ``reply - received`` rounds again, so its update can exceed the bound by a few
    float32 ulps (norm 1.00000005 here); the mod then scales it into the bound by at most 2**-21 relative
    (the first rescaling margin, 2**-22, was 1e-6: 1.3e-7 off on 24 entries of Flower's result). Within the
    bound nothing is rescaled and the server's model is Flower's reply bit for bit."""
    rng = np.random.default_rng(0)
    g = {"w": rng.normal(size=(20, 10)).astype(np.float32), "b": rng.normal(size=10).astype(np.float32)}
    t = {k: v + rng.normal(size=v.shape).astype(np.float32) for k, v in g.items()}
    cfg = {**EXACT, "clipping_norm": clip}
    flower = _flower_alone(mod, g, t, cfg)
    flower_update = {k: flower[k] - g[k] for k in g}
    norm = float(np.sqrt(sum(np.sum(u.astype(np.float64) ** 2) for u in flower_update.values())))
    s = CompressedStrategy(FedAvg(min_available_nodes=1, min_train_nodes=1, fraction_evaluate=0.0), compressor="none",
                           error_feedback=False)
    s.remember(1, FlatModel.from_numpy(g))
    arrays, _ = s.aggregate_train(1, [_stacked(mod, g, t, cfg)])
    server = {k: arrays[k].numpy() for k in g}
    sent = {k: server[k] - g[k] for k in g}
    if clip == 1.0:
        assert norm == pytest.approx(1.0000000518468002, abs=1e-15)  # Flower's own update: over the bound
        assert float(np.sqrt(sum(np.sum(u.astype(np.float64) ** 2) for u in sent.values()))) <= 1.0
        for k in g:
            size = np.abs(flower_update[k])
            assert np.all(np.abs(server[k] - flower[k]) <= 2.0**-21 * size + np.spacing(np.abs(flower[k]))), k
    else:
        assert norm < clip
        for k in g:
            assert np.array_equal(server[k], flower[k]), k


@pytest.mark.parametrize("scale,bit", [(1.0, 1), (0.01, 0)])
def test_adaptive_clipping_norm_bit_reaches_the_server(scale, bit):
    g = {"w": np.zeros(10, np.float32)}
    t = {"w": np.full(10, scale, np.float32)}  # norm sqrt(10) * scale against clipping norm 1
    reply = _stacked(adaptiveclipping_mod, g, t, {**EXACT, "clipping_norm": 1.0})
    assert reply.content["metrics"][KEY_NORM_BIT] == bit
    assert reply.content["metrics"]["num-examples"] == 10 and "compression-error" in reply.content["metrics"]


def test_clipping_mod_error_reply_goes_through_compression_mod_unchanged():
    """Without ``clipping_norm`` in the train config Flower's mod answers with an error; ours passes it on."""
    reply = _stacked(fixedclipping_mod, {"w": np.zeros(3, np.float32)}, {"w": np.ones(3, np.float32)}, EXACT)
    assert reply.has_error() and reply.error.code == ErrorCode.MOD_FAILED_PRECONDITION
    assert "clipping_norm" in reply.error.reason


def test_clipping_mod_outside_compression_mod_is_refused():
    """Flower's clipping mod needs dense weights in the reply: outside ours it cannot hold."""
    g, t = {"w": np.zeros(10, np.float32)}, {"w": np.ones(10, np.float32)}
    app = make_ffn(lambda m, c: reply_with(m, t), [fixedclipping_mod, compression_mod])
    with pytest.raises(CompositionError, match="must run INSIDE compression_mod"):
        app(train_msg(g, {**EXACT, "clipping_norm": 1.0}), make_ctx())


@pytest.mark.parametrize("sensitivity", [0.0, 1.0])
def test_local_dp_mod_inside_compression_mod_sends_its_noised_update(sensitivity):
    g, t = _model()
    dp = LocalDpMod(clipping_norm=1.0, sensitivity=sensitivity, epsilon=1.0, delta=0.1)
    np.random.seed(5)  # Flower's LocalDpMod draws from numpy's global generator
    sent = _decoded(_stacked(dp, g, t, EXACT))
    np.random.seed(5)
    alone = _flower_alone(dp, g, t, EXACT)
    for k in g:
        assert np.array_equal(sent[k], alone[k] - g[k])
    assert float(sent["s"]) == 2.0  # Flower leaves a 0-d array as it is (no clipping, no noise)
    if sensitivity == 0.0:
        assert float(np.linalg.norm(sent["v"])) == pytest.approx(3 * 5**0.5 / 7, rel=1e-6)


# -- message_size_mod / arrays_size_mod: every record of a fedcomp round is countable ----------------


def _sizes(caplog, what: str) -> list[int]:
    return [int(m.group(1)) for r in caplog.records if (m := re.search(rf"{what} message size: (\d+) bytes",
                                                                        r.getMessage()))]


def test_message_size_mod_counts_a_compressed_round(caplog):
    """CompressedStrategy's train messages and the compressed replies go through message_size_mod
    (outermost and inside compression_mod); the logged sizes are the records' byte counts."""
    g = {"w": np.zeros((20, 10), np.float32), "b": np.zeros(10, np.float32)}
    replies_seen = []
    for mods in ([message_size_mod, compression_mod], [compression_mod, message_size_mod],
                 [arrays_size_mod, compression_mod]):
        app = ClientApp(mods=mods)

        @app.train()
        def train(msg, ctx):
            received = {k: a.numpy() for k, a in msg.content["arrays"].items()}
            return reply_with(msg, {k: v + 0.5 for k, v in received.items()})

        grid = InProcessGrid(app, 2, {})
        s = CompressedStrategy(FedAvg(min_available_nodes=2, fraction_evaluate=0.0), compressor="fp16",
                               downstream="none")  # the upload's sizes on both sides of the mod
        msgs = list(s.configure_train(1, ArrayRecord({k: Array(v) for k, v in g.items()}), ConfigRecord({}), grid))
        sent = [sum(r.count_bytes() for r in m.content.values()) for m in msgs]
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="flwr"):
            replies = grid.send_and_receive(msgs)
        assert not any(r.has_error() for r in replies), [r.error.reason for r in replies if r.has_error()]
        arrays, _ = s.aggregate_train(1, replies)
        assert all(np.array_equal(arrays[k].numpy(), v + 0.5) for k, v in g.items())
        replies_seen.append([sum(r.count_bytes() for r in m.content.values()) for m in replies])
        if mods[0] is message_size_mod:
            assert _sizes(caplog, "Incoming") == sent
            assert _sizes(caplog, "Outgoing") == replies_seen[-1]
        elif mods[1] is message_size_mod:  # inside: the dense reply, larger than the compressed one
            assert _sizes(caplog, "Incoming") == sent
            assert all(d > c for d, c in zip(_sizes(caplog, "Outgoing"), replies_seen[-1], strict=True))


@pytest.mark.parametrize("codec", [{}, {"layer-codecs": "b=fp16"}, {"warmup-rounds": 1}])
def test_train_config_carries_no_empty_value_and_reads_back(codec):
    """flwr 1.42 cannot count an empty string in a ConfigRecord: a key whose value is empty is left
    out, and the client reads the absent key as its default."""
    c = CodecConfig.from_mapping(codec)
    for rnd in (1, 2):
        cfg = ConfigRecord()
        add_codec(c, rnd, cfg)
        assert "" not in cfg.values()
        assert cfg.count_bytes() > 0
        assert CodecConfig.from_mapping(dict(cfg), source="train config") == c.for_round(rnd)


def test_legacy_fit_config_carries_no_empty_value():
    """The legacy wrapper's FitIns config becomes a ConfigRecord on the wire: countable too."""
    from fedcomp.client.numpy_client import CompressedNumPyClient
    from fedcomp.strategies.legacy_strategy import LegacyCompressedStrategy
    from tests.strategies.legacy_helpers import LinRegClient, N, make_inner, manager

    s = LegacyCompressedStrategy(make_inner("fedavg"), compressor="sign")
    cm = manager([CompressedNumPyClient(LinRegClient(i)) for i in range(N)])
    (_, ins), *_ = s.configure_fit(1, s.initialize_parameters(cm), cm)
    assert "layer-codecs" not in ins.config and ins.config["compressor"] == "sign"
    assert ConfigRecord(dict(ins.config)).count_bytes() > 0


# -- Flower's SecAgg+ mod inside compression_mod ------------------------------------------------------


#: The two ways a SecAgg+ client stacks its mods: Flower's mod inside compression_mod, and fedcomp's
#: secagg_mod (Flower's mod behind fedcomp's request guard) as the docs stack it.
SECAGG_STACKS = {"flower": lambda: [compression_mod, secaggplus_mod], "fedcomp": lambda: [secagg_mod, compression_mod]}


def _secagg_app(ctx, stage: str, stack: str = "flower"):
    ctx.state[RECORD_KEY_STATE] = ConfigRecord(SecAggPlusState(current_stage=stage).to_dict())
    empty = make_ffn(lambda m, c: Message(RecordDict(), reply_to=m), SECAGG_STACKS[stack]())
    return lambda cfg: empty(make_msg(RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(cfg)}), dst=123), ctx)


@pytest.mark.parametrize("stack", list(SECAGG_STACKS))
def test_secaggplus_stage_transitions_hold_through_compression_mod(stack):
    """Allowed transitions get as far as the stage's own config check (KeyError here: the configs
    are empty); every other transition is refused with ValueError."""
    stages = Stage.all()
    allowed = {(a, b) for a, b in zip(stages, stages[1:] + stages[:1])} | {(s, Stage.SETUP) for s in stages}
    for now in stages:
        for nxt in stages:
            call = _secagg_app(make_ctx(node_id=123), now, stack)
            with pytest.raises(KeyError if (now, nxt) in allowed else ValueError):
                call({Key.STAGE: nxt})


@pytest.mark.parametrize("stack", list(SECAGG_STACKS))
def test_secaggplus_setup_config_types_are_checked_through_compression_mod(stack):
    setup = {Key.SAMPLE_NUMBER: 10, Key.SHARE_NUMBER: 10, Key.THRESHOLD: 10, Key.CLIPPING_RANGE: 1.0,
             Key.TARGET_RANGE: 10, Key.MOD_RANGE: 10}
    for key in setup:
        for wrong in ("text", b"b", True, 1.0 if key != Key.CLIPPING_RANGE else 10):
            call = _secagg_app(make_ctx(node_id=123), Stage.UNMASK, stack)
            with pytest.raises(TypeError):
                call({**setup, Key.STAGE: Stage.SETUP, key: wrong})
        call = _secagg_app(make_ctx(node_id=123), Stage.UNMASK, stack)
        with pytest.raises(KeyError):
            call({Key.STAGE: Stage.SETUP, **{k: v for k, v in setup.items() if k != key}})


@pytest.mark.parametrize("stack", list(SECAGG_STACKS))
def test_secaggplus_share_keys_and_collect_checks_keep_flowers_exception_types(stack):
    """Flower's share-keys and collect-masked-vectors checks: a wrong value is a TypeError, a missing
    key a KeyError, whichever stack the client uses."""
    for value in (b"public key 1", [b"public key 1"], [b"k1", b"k2", b"k3"]):
        call = _secagg_app(make_ctx(node_id=123), Stage.SETUP, stack)
        with pytest.raises(TypeError):
            call({Key.STAGE: Stage.SHARE_KEYS, "1": value, "2": [b"k1", b"k2"]})
    collect = {Key.CIPHERTEXT_LIST: [b"c1", b"c2"], Key.SOURCE_LIST: [32, 51324]}
    for key in collect:
        call = _secagg_app(make_ctx(node_id=123), Stage.SHARE_KEYS, stack)
        with pytest.raises(KeyError):
            call({Key.STAGE: Stage.COLLECT_MASKED_VECTORS, **{k: v for k, v in collect.items() if k != key}})
        call = _secagg_app(make_ctx(node_id=123), Stage.SHARE_KEYS, stack)
        with pytest.raises(TypeError):
            call({Key.STAGE: Stage.COLLECT_MASKED_VECTORS, **collect, key: [3.1415926]})


@pytest.mark.parametrize("stack", list(SECAGG_STACKS))
def test_secaggplus_unmask_checks_keep_flowers_exception_types(stack):
    """Flower's unmask check: a missing node-id list is a KeyError, a list of bools a TypeError. Through
    fedcomp's guard the refusal is fedcomp's own UnsafeRequest (naming the key) and of Flower's type."""
    unmask = {Key.ACTIVE_NODE_ID_LIST: [1, 2, 3, 4], Key.DEAD_NODE_ID_LIST: [32, 51324]}
    for key in unmask:
        call = _secagg_app(make_ctx(node_id=123), Stage.COLLECT_MASKED_VECTORS, stack)
        with pytest.raises(KeyError) as missing:
            call({Key.STAGE: Stage.UNMASK, **{k: v for k, v in unmask.items() if k != key}})
        call = _secagg_app(make_ctx(node_id=123), Stage.COLLECT_MASKED_VECTORS, stack)
        with pytest.raises(TypeError) as wrong:
            call({Key.STAGE: Stage.UNMASK, **unmask, key: [True, False, True, False]})
        if stack == "fedcomp":
            assert isinstance(missing.value, UnsafeRequest) and isinstance(wrong.value, UnsafeRequest)
            assert str(missing.value) == f"SecAgg+ unmask request: the required key '{key}' is missing"
            assert str(wrong.value) == (f"SecAgg+ unmask request: '{key}' must be a list of node ids, got "
                                        "[True, False, True, False]")


def test_secaggplus_collect_stage_goes_through_compression_mod_untouched():
    """The stage that carries the model: the masked vectors are SecAgg+'s, not ours to compress."""
    msg = train_msg({"w": np.zeros(3, np.float32)}, {"compressor": "sign"})
    msg.content[RECORD_KEY_CONFIGS] = ConfigRecord({Key.STAGE: Stage.COLLECT_MASKED_VECTORS})
    reply = reply_with(msg, {"w": np.ones(3, np.float32)})
    seen = []
    assert compression_mod(msg, make_ctx(), lambda m, c: seen.append(m) or reply) is reply
    assert seen == [msg] and reply.content["arrays"]["w"].stype != PAYLOAD_STYPE
