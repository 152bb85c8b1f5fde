"""A curious server on the SecAgg+ path: unmasking one client, splitting its
neighbours with a low threshold, switching a node's own compression and privacy floor off, and a
client masking another weight than the num-examples it reports."""

from __future__ import annotations

import typing

import numpy as np
import pytest
from flwr.app import Error, Message
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

from tests.secagg import helpers


def _stage(m):
    rec = m.content.config_records.get(RECORD_KEY_CONFIGS)
    return None if rec is None else rec.get(Key.STAGE)


class _UnmaskingGrid(helpers.RecordingGrid):
    """Lists the victim (partition 0) as dropped too wherever an unmask request lists it alive; keeps the
    unmask replies (and hands Flower's server error replies instead: it only had to collect the shares)."""

    replies: typing.ClassVar[list] = []

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        victim = self.node_ids[0]
        for m in messages:
            if _stage(m) == Stage.UNMASK:
                rec = m.content.config_records[RECORD_KEY_CONFIGS]
                if victim in rec[Key.ACTIVE_NODE_ID_LIST]:
                    rec[Key.DEAD_NODE_ID_LIST] = [*rec[Key.DEAD_NODE_ID_LIST], victim]
        out = list(super().send_and_receive(messages, timeout=timeout))
        if any(_stage(m) == Stage.UNMASK for m in messages):
            type(self).replies = out
            return [Message(Error(code=2, reason="kept by the test"), reply_to=m) for m in messages]
        return out


def test_clients_refuse_an_unmask_request_listing_a_node_alive_and_dropped(monkeypatch):
    monkeypatch.setattr(helpers, "RecordingGrid", _UnmaskingGrid)
    _UnmaskingGrid.replies = []
    _, strategy, _, grid = helpers.run_round(5, 0.5)
    replies = _UnmaskingGrid.replies
    assert len(replies) == 5
    victim = grid.node_ids[0]
    handed = [r for r in replies if not r.has_error()
              and r.content.config_records[RECORD_KEY_CONFIGS][Key.NODE_ID_LIST].count(victim) > 1]
    assert handed == []  # no client hands over both shares of the victim
    assert all(r.has_error() and "both alive and dropped" in r.error.reason for r in replies)
    assert 1 not in strategy.history  # the round is lost, the model kept: nothing unmasked


class _SplittingGrid(helpers.RecordingGrid):
    """Lowers the setup's threshold to half the shares (what a server splitting neighbours needs)."""

    replies: typing.ClassVar[list] = []

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        for m in messages:
            if _stage(m) == Stage.SETUP:
                rec = m.content.config_records[RECORD_KEY_CONFIGS]
                rec[Key.THRESHOLD] = rec[Key.SHARE_NUMBER] // 2
        out = list(super().send_and_receive(messages, timeout=timeout))
        if any(_stage(m) == Stage.SETUP for m in messages):
            type(self).replies = out
        return out


def test_clients_refuse_a_setup_whose_threshold_allows_splitting(monkeypatch):
    monkeypatch.setattr(helpers, "RecordingGrid", _SplittingGrid)
    _, strategy, _, _ = helpers.run_round(4, 0.5)
    assert len(_SplittingGrid.replies) == 4
    assert all(r.has_error() and "threshold 2 of 4 shares" in r.error.reason for r in _SplittingGrid.replies)
    assert 1 not in strategy.history


@pytest.mark.parametrize("cfg,bound", [({"secagg-threshold": 0.5}, "fraction > 0.5"),
                                       ({"secagg-threshold": 0.3}, "fraction > 0.5"),
                                       ({"secagg-shares": 6, "secagg-threshold": 3}, "integer > secagg-shares / 2")])
def test_a_threshold_of_at_most_half_the_shares_is_refused_at_start_up(cfg, bound):
    from fedcomp.config.secagg import SecAggConfig
    with pytest.raises(ValueError, match=rf"'secagg-threshold' = .* allows at most half .*{bound}"):
        SecAggConfig.from_run_config(cfg)


def test_thresholds_above_half_the_shares_are_accepted():
    from fedcomp.config.secagg import SecAggConfig
    assert SecAggConfig.from_run_config({"secagg-threshold": 0.51}).threshold == 0.51
    assert SecAggConfig.from_run_config({"secagg-shares": 6, "secagg-threshold": 4}).threshold == 4


def _reweighting_grid(shift_in_q):
    """A client (partition 1) that masks its weight entry shifted by ``shift_in_q`` * Q (mod the modulus)
    while reporting its true num-examples: what a client running its own SecAgg+ code can send."""
    from fedcomp.secagg.protocol_packing import pack_masked, unpack_masked

    def shift(blobs):
        bits = blobs[0][5]
        w = (unpack_masked(blobs[0], bits) + shift_in_q * (1 << 16)) % (1 << bits)
        return [pack_masked(w, bits), blobs[1]]
    return helpers.tampering_grid(shift, victim=1)


@pytest.mark.parametrize("shift", [3, -1, -2], ids=["inflated", "zero-ish", "negative"])
def test_a_masked_weight_other_than_the_reported_count_refuses_the_round(monkeypatch, caplog, shift):
    monkeypatch.setattr(helpers, "RecordingGrid", _reweighting_grid(shift))
    new, strategy, workflow, _ = helpers.run_round(4, 0.5)
    assert 1 not in strategy.history  # the sum never reached the strategy
    g = helpers.global_model()
    assert all(np.array_equal(new[k], g[k]) for k in g)  # the model is kept
    assert "unmasked weight sum" in workflow.round_skipped[1] and "reported num-examples" in workflow.round_skipped[1]


def test_an_honest_round_passes_the_weight_check():
    _, strategy, workflow, _ = helpers.run_round(4, 0.5)
    assert strategy.history[1]["num-replies"] == 4 and workflow.round_skipped == {}


def _plain_train_reply(seed_key: bool, node_config: dict | None = None):
    """The reply of a node of fedcomp's app (secagg_mod, compression_mod) to a plain train message."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

    from fedcomp.client import compression_mod
    from fedcomp.protocol.messages import SECAGG_SEED_KEY
    from fedcomp.run.inprocess_grid import InProcessGrid
    from fedcomp.secagg import secagg_mod

    grid = InProcessGrid(helpers.make_client_app(mods=(secagg_mod, compression_mod)), 1, {}, [node_config or {}])
    g = helpers.global_model()
    cfg = {"server-round": 1, "compressor": "randomk", "density": 0.5, **({SECAGG_SEED_KEY: 7} if seed_key else {})}
    content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in g.items()}), "config": ConfigRecord(cfg)})
    (reply,) = grid.send_and_receive([grid.create_message(content, "train", 1000, "1")])
    return reply


@pytest.mark.parametrize("node_config", [{"dp": "local", "noise-multiplier": 1.0, "clipping-norm": 1.0}, {}],
                         ids=["local-dp-floor", "no-floor"])
def test_the_shared_seed_key_does_not_switch_compression_mod_off(node_config, caplog):
    """A plain train message carrying the SecAgg+ seed key: on main compression_mod stepped aside and
    the node returned raw weights (its local-DP floor ignored). Now it is refused and logged."""
    from fedcomp.protocol.messages import PAYLOAD_STYPE
    reply = _plain_train_reply(True, node_config)
    raw = (not reply.has_error()) and any(a.stype != PAYLOAD_STYPE for rec in reply.content.array_records.values()
                                          for a in rec.values())
    assert not raw
    assert reply.has_error() and "fedcomp-secagg-seed" in reply.error.reason


def test_without_the_seed_key_the_same_message_is_compressed():
    from fedcomp.protocol.messages import PAYLOAD_STYPE
    reply = _plain_train_reply(False)
    assert not reply.has_error()
    assert all(a.stype == PAYLOAD_STYPE for a in reply.content["arrays"].values())


@pytest.mark.parametrize("node_config,why", [
    ({"dp": "local", "noise-multiplier": 1.0, "clipping-norm": 1.0}, "dp = 'local'"),
    ({"compressor": "sign"}, "compressor = 'sign'"),
    ({"density": 0.1}, "density = 0.1"),
], ids=["local-dp", "codec", "density"])
def test_a_node_whose_own_settings_the_secure_round_would_lower_refuses_it(node_config, why, caplog):
    import logging

    from fedcomp.client import compression_mod
    from fedcomp.secagg import secagg_mod
    caplog.set_level(logging.ERROR, logger="flwr")
    _, strategy, _, _ = helpers.run_round(4, 0.5, node_configs=[node_config, {}, {}, {}],
                                          mods=(secagg_mod, compression_mod))
    assert strategy.history[1]["num-replies"] == 3  # the node kept its floor and sent nothing
    assert any(why in r.getMessage() and "refuses the secure round" in r.getMessage() for r in caplog.records)


def test_node_settings_the_secure_round_honours_are_accepted():
    from fedcomp.client import compression_mod
    from fedcomp.secagg import secagg_mod
    _, strategy, _, _ = helpers.run_round(3, 0.5, node_configs=[{"density": 0.5}, {"compressor": "randomk"}, {}],
                                          mods=(secagg_mod, compression_mod))
    assert strategy.history[1]["num-replies"] == 3


class _SetupRecordingGrid(helpers.RecordingGrid):
    thresholds: typing.ClassVar[list] = []

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        type(self).thresholds += [m.content.config_records[RECORD_KEY_CONFIGS][Key.THRESHOLD]
                                  for m in messages if _stage(m) == Stage.SETUP]
        return super().send_and_receive(messages, timeout=timeout)


def test_a_fractional_threshold_rounded_to_half_the_shares_is_raised_to_a_majority(monkeypatch):
    """secagg-threshold 0.6 of 4 shares rounds to 2 in Flower (half): the workflow sends 3, and the round runs."""
    monkeypatch.setattr(helpers, "RecordingGrid", _SetupRecordingGrid)
    _SetupRecordingGrid.thresholds = []
    _, strategy, _, _ = helpers.run_round(4, 0.5, threshold=0.6)
    assert set(_SetupRecordingGrid.thresholds) == {3}
    assert strategy.history[1]["num-replies"] == 4


def test_a_refused_unmask_request_erases_the_shares_and_ends_the_round():
    """After refusing, the client holds no share of the round and accepts only a new setup: a second,
    innocent-looking unmask request of the same round reveals nothing either."""
    from flwr.app import ConfigRecord, RecordDict
    from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_STATE

    from fedcomp.secagg import packing_secaggplus_mod
    from fedcomp.secagg.guard import UnsafeRequest
    from tests.messages import make_ctx, make_msg

    ctx = make_ctx(node_id=7)
    shares = {7: b"s7", 8: b"s8", 9: b"s9"}
    ctx.state[RECORD_KEY_STATE] = ConfigRecord(SecAggPlusState(
        current_stage=Stage.COLLECT_MASKED_VECTORS, nid=7, threshold=2, share_num=3,
        rd_seed_share_dict=dict(shares), sk1_share_dict=dict(shares)).to_dict())

    def unmask(active, dead):
        cfg = ConfigRecord({Key.STAGE: Stage.UNMASK, Key.ACTIVE_NODE_ID_LIST: active, Key.DEAD_NODE_ID_LIST: dead})
        return packing_secaggplus_mod(make_msg(RecordDict({RECORD_KEY_CONFIGS: cfg}), dst=7), ctx,
                                      lambda m, c: pytest.fail("no training in the unmask stage"))

    with pytest.raises(UnsafeRequest, match=r"node\(s\) \[8\] as both alive and dropped"):
        unmask([7, 8], [8])
    state = SecAggPlusState(**ctx.state[RECORD_KEY_STATE])
    assert state.rd_seed_share_dict == {} and state.sk1_share_dict == {} and state.current_stage == Stage.UNMASK
    with pytest.raises(ValueError, match="expect setup stage"):
        unmask([7, 8, 9], [])
    with pytest.raises(UnsafeRequest, match=r"this node \(7\) as dropped"):
        unmask([8, 9], [7])


@pytest.mark.parametrize("n,ok", [(1000, True), (1, True), (1001, False), (0, False), (-5, False)])
def test_the_dense_secure_path_bounds_the_weight_a_client_masks(n, ok):
    """Without a shared seed (dense SecAgg+) the client's weight is num_examples / max_weight too: on main
    Flower's mod only warned above max_weight and masked the outsized (or negative) weight."""
    import numpy as np
    from flwr.app import ConfigRecord, RecordDict
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_STATE
    from flwr.compat.common import recorddict_compat as compat

    from fedcomp.secagg import shared_randomk_mod
    from tests.messages import make_ctx, make_msg

    ctx = make_ctx()
    ctx.state[RECORD_KEY_STATE] = ConfigRecord({"clipping_range": 1.0, "target_range": 1 << 16, "max_weight": 1000.0})
    msg = make_msg(RecordDict({"fitins.config": ConfigRecord({"server-round": 1})}))
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([np.zeros(3)]), n, {})
    reply_to = lambda m, c: Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=m)
    if ok:
        assert not shared_randomk_mod(msg, ctx, reply_to).has_error()
    else:
        with pytest.raises(ValueError, match="num-examples = "):
            shared_randomk_mod(msg, ctx, reply_to)
