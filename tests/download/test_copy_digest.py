"""A node's model copy cannot drift from the server's record silently: every reply to a versioned
download (train and evaluate) carries a digest of the copy the node holds, the server compares it with
its record, and a node whose copy differs is forgotten (a first contact next time, counted in
``copy-resyncs``); a reply without the digest (an older fedcomp) is refused, naming the upgrade."""

import logging

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import FedAvg

from fedcomp.app.client_app import app as client_app
from fedcomp.download.layout import copy_digest
from fedcomp.protocol.messages import COPY_RECORD, MODEL_STATE_KEY
from fedcomp.run.inprocess_grid import InProcessGrid
from fedcomp.statedict import FlatModel
from fedcomp.strategies import CompressedStrategy, Download
from fedcomp.download.sender import NO_COPY_REPORT
from fedcomp.task.models import build_model

logging.getLogger("flwr").setLevel(logging.WARNING)


def _federation(nodes=3, init="auto"):
    grid = InProcessGrid(client_app, nodes, {"lr": 0.1})
    s = CompressedStrategy(FedAvg(min_available_nodes=nodes, min_train_nodes=nodes, min_evaluate_nodes=nodes),
                           compressor="stc", density=0.05, downstream=Download("stc", init=init))
    return grid, s, ArrayRecord(build_model().state_dict())


def _round(s, grid, rnd, arrays, edit=None):
    msgs = list(s.configure_train(rnd, arrays, ConfigRecord({"seed": 1}), grid))
    replies = grid.send_and_receive(msgs)
    if edit is not None:
        replies = [edit(r) for r in replies]
    arrays, _ = s.aggregate_train(rnd, replies)
    return arrays, {m.metadata.dst_node_id: s.downstream.sent_kind[m.metadata.dst_node_id] for m in msgs}


def _matches_record(s, grid, node) -> bool:
    held = FlatModel.from_record(grid.contexts[node].state[MODEL_STATE_KEY])
    return np.array_equal(held.flat, s.downstream.held(node))


def test_the_digest_is_one_value_for_one_copy():
    """Equal copies give equal digests (-0.0 and +0.0 alike); a change of one entry by 1e-7 does not."""
    a = FlatModel.from_numpy({"w": np.array([0.0, 1.5, -2.0], np.float32), "n": np.array(3, np.int64)})
    b = FlatModel.from_numpy({"w": np.array([-0.0, 1.5, -2.0], np.float32), "n": np.array(3, np.int64)})
    c = FlatModel.from_numpy({"w": np.array([0.0, 1.5 + 1e-7, -2.0], np.float32), "n": np.array(3, np.int64)})
    assert copy_digest(a) == copy_digest(b) and len(copy_digest(a)) == 8
    assert copy_digest(a) != copy_digest(c)


def test_copies_that_match_report_no_resync_in_train_and_evaluate():
    """Partial participation with evaluation (new, lagging and current copies): no copy differs."""
    grid = InProcessGrid(client_app, 4, {"lr": 0.1})
    s = CompressedStrategy(FedAvg(fraction_train=0.5, min_train_nodes=2, min_available_nodes=4,
                                  fraction_evaluate=0.5, min_evaluate_nodes=2), compressor="sign",
                           downstream=Download("stc", density=0.05))
    arrays = ArrayRecord(build_model().state_dict())
    for rnd in range(1, 6):
        arrays, _ = _round(s, grid, rnd, arrays)
        ev = list(s.configure_evaluate(rnd, arrays, ConfigRecord({}), grid))
        s.aggregate_evaluate(rnd, grid.send_and_receive(ev))
        assert s.history[rnd]["copy-resyncs"] == 0 and s.history[rnd]["rejected-replies"] == 0


def test_a_changed_copy_is_found_at_the_next_reply_and_resynchronised(caplog):
    """A copy altered by 1e-3 in one entry on the node is found at its next reply (counted, logged with
    the node), the node gets a first contact next, and from then on its copy is the record again."""
    grid, s, arrays = _federation()
    for rnd in (1, 2):
        arrays, _ = _round(s, grid, rnd, arrays)
        assert s.history[rnd]["copy-resyncs"] == 0
    node = sorted(grid.contexts)[1]
    state = grid.contexts[node].state
    key = next(k for k, a in state[MODEL_STATE_KEY].items() if a.dtype == "float32" and a.numpy().size > 10)
    altered = state[MODEL_STATE_KEY][key].numpy().copy()
    altered.reshape(-1)[3] += 1e-3
    state[MODEL_STATE_KEY][key] = Array(altered)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        arrays, _ = _round(s, grid, 3, arrays)
    assert s.history[3]["copy-resyncs"] == 1 and s.history[3]["num-replies"] == 3  # its update still counts
    assert f"node(s) [{node}]" in caplog.text and "differs from the server's record" in caplog.text
    assert node not in s.downstream.nodes.node_version
    arrays, kinds = _round(s, grid, 4, arrays)
    assert kinds[node].startswith("init") and s.history[4]["copy-resyncs"] == 0
    assert all(_matches_record(s, grid, n) for n in grid.contexts)


def test_a_node_whose_generator_draws_the_seeded_start_differently_is_resynchronised(monkeypatch):
    """A seeded start drawn differently on the nodes (another generator) is found at the first reply of
    every node: counted each round instead of training from a model far from the record unnoticed."""
    import fedcomp.download.receiver as receiver

    draw = receiver.seeded_tensor
    monkeypatch.setattr(receiver, "seeded_tensor", lambda *a, **k: draw(*a, **k) + np.float32(0.01))
    grid, s, arrays = _federation(init="seeded")
    arrays, kinds = _round(s, grid, 1, arrays)
    assert all(k == "init" for k in kinds.values()) and s.history[1]["copy-resyncs"] == 3
    arrays, kinds = _round(s, grid, 2, arrays)
    assert all(k.startswith("init") for k in kinds.values()) and s.history[2]["copy-resyncs"] == 3
    monkeypatch.setattr(receiver, "seeded_tensor", draw)  # the nodes' generator fixed: in sync again
    arrays, _ = _round(s, grid, 3, arrays)
    arrays, kinds = _round(s, grid, 4, arrays)
    assert s.history[3]["copy-resyncs"] == 0 and s.history[4]["copy-resyncs"] == 0
    assert not any(k.startswith("init") for k in kinds.values())


@pytest.mark.parametrize("phase", ["train", "evaluate"])
def test_a_reply_without_the_digest_is_refused_naming_the_upgrade(phase, caplog):
    """An older fedcomp on the node (no ``fedcomp.copy`` in its reply): a train reply is refused with a
    reason that says what to upgrade; after an evaluate reply the node is forgotten (first contact next)."""
    grid, s, arrays = _federation(2)
    arrays, _ = _round(s, grid, 1, arrays)
    old = sorted(grid.contexts)[0]

    def strip(reply):
        if reply.metadata.src_node_id == old:
            del reply.content[COPY_RECORD]
        return reply

    with caplog.at_level(logging.WARNING, logger="flwr"):
        if phase == "train":
            arrays, _ = _round(s, grid, 2, arrays, edit=strip)
            assert s.history[2]["rejected-replies"] == 1 and s.history[2]["num-replies"] == 1
        else:
            ev = list(s.configure_evaluate(1, arrays, ConfigRecord({}), grid))
            assert len(ev) == 2
            s.aggregate_evaluate(1, [strip(r) for r in grid.send_and_receive(ev)])
    assert f"node {old}" in caplog.text and NO_COPY_REPORT in caplog.text
    assert "upgrade fedcomp on that node" in NO_COPY_REPORT
    arrays, kinds = _round(s, grid, 3 if phase == "train" else 2, arrays)
    assert kinds[old].startswith("init")  # its copy is unknown: a first contact


@pytest.mark.parametrize("stats", ["small", "auto"])
def test_the_server_digests_its_record_piecewise_as_the_node_digests_its_copy(stats):
    """The server's digest of a node's copy, made tensor by tensor from what it keeps (no model-sized
    copy), equals the digest of the whole model it believes the node holds (BatchNorm statistics
    exact, or each node's own sign-coded copy of them)."""
    grid = InProcessGrid(client_app, 2, {"lr": 0.1})
    s = CompressedStrategy(FedAvg(min_available_nodes=2, min_train_nodes=2, fraction_evaluate=0.0),
                           compressor="stc", density=0.05, downstream="stc", batchnorm_stats=stats)
    arrays = ArrayRecord(build_model().state_dict())
    for rnd in (1, 2):
        arrays, _ = _round(s, grid, rnd, arrays)
    for node in grid.contexts:
        assert s.downstream.copy_digest(node) == copy_digest(s.downstream._held_model(node))
        assert _matches_record(s, grid, node)


@pytest.mark.parametrize("bad", [{"digest": b"x" * 7}, {"digest": "abcdefgh"}, {"digest": 5}, {"other": b"12345678"}],
                         ids=["short", "str", "int", "no-digest-key"])
def test_a_malformed_digest_is_refused_and_a_wrong_one_resynchronises(bad):
    """A copy record that is not an 8-byte digest refuses the train reply (the node is forgotten: a first
    contact next); a well-formed digest of another copy counts the reply and re-synchronises the node."""
    grid, s, arrays = _federation(2)
    arrays, _ = _round(s, grid, 1, arrays)
    node = sorted(grid.contexts)[0]

    def record(content):
        def edit(reply):
            if reply.metadata.src_node_id == node:
                reply.content[COPY_RECORD] = ConfigRecord(content)
            return reply
        return edit

    arrays, _ = _round(s, grid, 2, arrays, edit=record(bad))
    assert s.history[2]["rejected-replies"] == 1 and s.history[2]["num-replies"] == 1
    arrays, kinds = _round(s, grid, 3, arrays, edit=record({"digest": b"\x00" * 8}))
    assert kinds[node].startswith("init")
    assert s.history[3]["num-replies"] == 2 and s.history[3]["copy-resyncs"] == 1
    arrays, kinds = _round(s, grid, 4, arrays)
    assert kinds[node].startswith("init") and s.history[4]["copy-resyncs"] == 0
