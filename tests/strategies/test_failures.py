"""A client that fails is named with its reason in the log and metrics.json, never a silent dropout:
Flower's error replies (a ClientApp that died: code 8; a node gone: code 5, answered by the SuperLink
from its own node id), sampled nodes with no reply, and OOM kills the client's container counted."""

import logging
import time

from flwr.app import Error, Message, Metadata, MetricRecord, RecordDict
from flwr.app.message import make_message
from flwr.serverapp.strategy import FedAvg

from fedcomp.client import compression_mod
from fedcomp.protocol.device import memory_limit_mb, oom_kills
from fedcomp.statedict import FlatModel
from fedcomp.strategies import CompressedStrategy
from fedcomp.strategies.failures import (CRASHED_REASON, GONE_REASON, NO_REPLY_REASON, STRANGER_REASON, UNTRACED_REASON,
                                       round_failures)
from tests.messages import make_ctx, reply_with, train_msg, weights


def _ok(g, t, msg, oom=0.0):
    def app(m, c):
        return reply_with(m, t, n=10)

    r = compression_mod(msg, make_ctx(node_id=msg.metadata.dst_node_id), app)
    r.content["metrics"]["client-oom-kills"] = oom
    return r


def _superlink_error(msg, code, reason, src=1):
    """An error reply to ``msg`` from node ``src`` (default: the SuperLink's own id, 1)."""
    md = Metadata(run_id=1, message_id="", src_node_id=src, dst_node_id=1, reply_to_message_id=msg.metadata.message_id,
                  group_id="1", created_at=time.time(), ttl=10.0, message_type="train")
    return make_message(metadata=md, error=Error(code, reason))


def _round(s, g, nodes):
    msgs = [train_msg(g, {"compressor": "stc", "density": 0.5}, dst=n) for n in nodes]
    s.remember(1 if not s.history else max(s.history) + 1, FlatModel.from_numpy(g), nodes=set(nodes))
    s.sent_round.messages = msgs
    s.history.setdefault(s.sent_round.server_round, {})
    return msgs


def test_dead_clientapp_gone_node_and_silent_node_are_named_with_reasons(caplog):
    g, t = weights(0), weights(1)
    s = CompressedStrategy(FedAvg(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1), compressor="stc")
    m = _round(s, g, [11, 12, 13, 14])
    crashed = Message(Error(8, "ClientApp stopped responding."), reply_to=m[1])  # the node answers for its ClientApp
    gone = _superlink_error(m[2], 5, "Error: Node Unavailable - The destination node is currently unavailable.")
    with caplog.at_level(logging.WARNING, logger="flwr"):
        _, _ = s.aggregate_train(1, [_ok(g, t, m[0]), crashed, gone])  # node 14: nothing at all
        metrics = s.history[1]  # the round's own figures (Flower gets the headline ones)
    assert metrics["num-replies"] == 1 and metrics["failed-clients"] == 3
    assert s.failure_history[1] == [
        {"node": 12, "code": 8, "error": "CLIENT_APP_CRASHED",
         "reason": f"{CRASHED_REASON} (Flower: 'ClientApp stopped responding.')"},
        {"node": 13, "code": 5, "error": "NODE_UNAVAILABLE",
         "reason": f"{GONE_REASON} (Flower: 'Error: Node Unavailable - The destination node is currently "
                   "unavailable.')"},
        {"node": 14, "code": -1, "error": "NO_REPLY", "reason": NO_REPLY_REASON}]
    text = caplog.text
    assert ("round 1: client (node 12) failed: the ClientApp process ended without replying: killed by a signal "
            "(SIGKILL, exit code 137 in a container) — likely out of memory") in text
    assert "round 1: client (node 13) failed: the SuperNode went away" in text
    assert "round 1: client (node 14) failed: no reply before the round's timeout" in text
    assert "node 1)" not in text  # never the SuperLink's own id


def test_raised_exception_keeps_flowers_reason():
    g = weights(0)
    s = CompressedStrategy(FedAvg(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1), compressor="stc")
    m = _round(s, g, [21])
    s.aggregate_train(1, [Message(Error(2, "ValueError: boom"), reply_to=m[0])])
    assert s.failure_history[1] == [{"node": 21, "code": 2, "error": "CLIENT_APP_RAISED_EXCEPTION",
                                     "reason": "ValueError: boom"}]


def test_oom_kills_in_a_nodes_container_are_named_when_it_reports_again(caplog):
    g, t = weights(0), weights(1)
    s = CompressedStrategy(FedAvg(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1), compressor="stc")
    m = _round(s, g, [31, 32])
    with caplog.at_level(logging.WARNING, logger="flwr"):
        s.aggregate_train(1, [_ok(g, t, m[0]), Message(Error(8, "ClientApp stopped responding."), reply_to=m[1])])
        m = _round(s, g, [31, 32])
        s.aggregate_train(2, [_ok(g, t, m[0]), _ok(g, t, m[1], oom=1.0)])
        m = _round(s, g, [31, 32])
        s.aggregate_train(3, [_ok(g, t, m[0]), _ok(g, t, m[1], oom=1.0)])  # no new kill: said once
    lines = [r.getMessage() for r in caplog.records if "out-of-memory killer" in r.getMessage()]
    assert lines == [("round 2: node 32: the kernel's out-of-memory killer killed 1 process(es) in its container since "
                     "the server last heard from it (oom_kill count 0 -> 1): its ClientApp ran out of memory")]
    assert s.failure_history[2] == [] and s.failure_history[3] == []


def test_cgroup_memory_limit_and_oom_count_files(tmp_path):
    v2max, v1lim, none = tmp_path / "memory.max", tmp_path / "limit_in_bytes", tmp_path / "absent"
    v2max.write_text("536870912\n")
    assert memory_limit_mb((str(none), str(v2max))) == 512.0
    v2max.write_text("max\n")
    assert memory_limit_mb((str(v2max),)) == 0.0
    v1lim.write_text("9223372036854771712\n")  # cgroup v1 without a limit
    assert memory_limit_mb((str(v1lim),)) == 0.0
    v1lim.write_text("1073741824\n")
    assert memory_limit_mb((str(v1lim),)) == 1024.0
    assert memory_limit_mb((str(none),)) == 0.0
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n")
    assert oom_kills((str(none), str(events))) == 2
    ctl = tmp_path / "memory.oom_control"
    ctl.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 7\n")
    assert oom_kills((str(ctl),)) == 7
    assert oom_kills((str(none),)) == 0


def test_a_client_that_fails_to_evaluate_is_named():
    g = weights(0)
    s = CompressedStrategy(FedAvg(fraction_evaluate=1.0, min_available_nodes=1, min_evaluate_nodes=1),
                           compressor="stc")
    msgs = [train_msg(g, dst=n) for n in (41, 42)]
    s._evaluate_sent = msgs  # what configure_evaluate keeps
    dead = _superlink_error(msgs[1], 5, "Node Unavailable")
    ok = Message(content=RecordDict({"metrics": MetricRecord({"num-examples": 5, "eval-loss": 0.5, "eval-acc": 0.9})}),
                 reply_to=msgs[0])
    s.aggregate_evaluate(3, [ok, dead])
    assert s.evaluate_failure_history[3] == [{"node": 42, "code": 5, "error": "NODE_UNAVAILABLE",
                                              "reason": f"{GONE_REASON} (Flower: 'Node Unavailable')"}]


def test_a_hostile_error_reason_is_one_bounded_log_line(caplog):
    g = weights(0)
    s = CompressedStrategy(FedAvg(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1), compressor="stc")
    m = _round(s, g, [51])
    hostile = "A" * 10_000_000 + "\nINFO : forged line\x1b[31m"
    with caplog.at_level(logging.WARNING, logger="flwr"):
        s.aggregate_train(1, [Message(Error(2, hostile), reply_to=m[0])])
    (line,) = [r.getMessage() for r in caplog.records if "failed:" in r.getMessage()]
    assert line == "round 1: client (node 51) failed: " + "A" * 500
    assert s.failure_history[1][0]["reason"] == "A" * 500
    s2 = CompressedStrategy(FedAvg(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1), compressor="stc")
    m = _round(s2, g, [52])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        s2.aggregate_train(1, [Message(Error(2, "boom\nINFO : forged\x1b[31m"), reply_to=m[0])])
    (line,) = [r.getMessage() for r in caplog.records if "failed:" in r.getMessage()]
    assert line == "round 1: client (node 52) failed: boom\\nINFO : forged\\x1b[31m"


def _failure_lines(caplog):
    return [r.getMessage() for r in caplog.records if "failed:" in r.getMessage() or "not counted" in r.getMessage()]


def test_an_untraceable_error_reply_hides_no_silent_node(caplog):
    """Attack finding F2: a SuperLink error reply that names no message of the round used to hide every
    silent node from the failure count; now each sampled node without a reply is counted and named once,
    and the untraceable reply is said as such."""
    g, t = weights(0), weights(1)
    s = CompressedStrategy(FedAvg(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1), compressor="stc")
    m = _round(s, g, [61, 62, 63])
    stray = _superlink_error(train_msg(g, dst=99), 5, "Node Unavailable")  # answers a message never sent this round
    with caplog.at_level(logging.WARNING, logger="flwr"):
        _, _ = s.aggregate_train(1, [_ok(g, t, m[0]), stray])
        metrics = s.history[1]  # the round's own figures (Flower gets the headline ones)
    assert metrics["failed-clients"] == 2 and metrics["num-replies"] == 1 and metrics["uncharged-error-replies"] == 1
    assert s.failure_history[1] == [{"node": 62, "code": -1, "error": "NO_REPLY", "reason": NO_REPLY_REASON},
                                    {"node": 63, "code": -1, "error": "NO_REPLY", "reason": NO_REPLY_REASON}]
    assert _failure_lines(caplog) == [
        "round 1: error reply from node 1 (answering a message this round did not send) not counted: "
        f"{UNTRACED_REASON}; its reason: Node Unavailable",
        "round 1: client (node 62) failed: no reply before the round's timeout",
        "round 1: client (node 63) failed: no reply before the round's timeout"]


def test_an_error_reply_is_charged_to_its_sender_not_to_the_node_its_reply_to_names(caplog):
    """Attack finding F3: an error reply naming node 72's message, sent by node 71 (sampled), is charged to
    71; one sent by node 79 (not sampled) is charged to nobody; 72 sent nothing and is counted once as silent;
    a second error reply of 71 is not counted twice."""
    g = weights(0)
    s = CompressedStrategy(FedAvg(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1), compressor="stc")
    m = _round(s, g, [71, 72])
    forged = _superlink_error(m[1], 2, "boom", src=71)
    again = Message(Error(2, "boom again"), reply_to=m[0])
    stranger = _superlink_error(m[1], 2, "not me", src=79)
    assert (forged.metadata.src_node_id, forged.metadata.reply_to_message_id) == (71, m[1].metadata.message_id)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        _, _ = s.aggregate_train(1, [forged, again, stranger])
        metrics = s.history[1]  # the round's own figures (Flower gets the headline ones)
    charged = "boom (the reply names the message sent to node 72: charged to its sender)"
    assert metrics["failed-clients"] == 2 and metrics["uncharged-error-replies"] == 1
    assert s.failure_history[1] == [
        {"node": 71, "code": 2, "error": "CLIENT_APP_RAISED_EXCEPTION", "reason": charged},
        {"node": 72, "code": -1, "error": "NO_REPLY", "reason": NO_REPLY_REASON}]
    assert _failure_lines(caplog) == [
        f"round 1: client (node 71) failed: {charged}",
        f"round 1: error reply from node 79 (answering the message sent to node 72) not counted: {STRANGER_REASON}; "
        "its reason: not me",
        "round 1: client (node 72) failed: no reply before the round's timeout"]


def test_round_failures_each_sampled_node_once():
    """The pure rule: a node with an update is not failed even if it also sent an error reply; a
    SuperLink reply for a sent message is charged to that message's node; unknown sampling charges the
    sender of every error reply and names no silent node."""
    g = weights(0)
    msgs = [train_msg(g, dst=n) for n in (81, 82, 83)]
    sent_to = {x.metadata.message_id: x.metadata.dst_node_id for x in msgs}
    errs = [Message(Error(2, "x"), reply_to=msgs[0]), _superlink_error(msgs[1], 4, "lost"),
            _superlink_error(msgs[1], 4, "lost again")]
    charged, uncharged, silent = round_failures(errs, sent_to, {81, 82, 83}, answered={81})
    assert [f["node"] for _, f in charged] == [82] and uncharged == []
    assert silent == [{"node": 83, "code": -1, "error": "NO_REPLY", "reason": NO_REPLY_REASON}]
    charged, uncharged, silent = round_failures(errs[:1], {}, None, answered=set())
    assert [f["node"] for _, f in charged] == [81] and uncharged == [] and silent == []


def test_evaluation_failures_follow_the_train_rules(caplog):
    """Attack finding: aggregate_evaluate logged a client's error reason raw (a newline and an escape sequence
    forged a second console line), counted a node's second error reply as a second failure, charged an error
    reply from a node never sent an evaluate message, hid a node that sent nothing, and let the inner strategy
    average a duplicate and a stranger's metrics in. Now: the train round's rules."""
    g = weights(0)
    s = CompressedStrategy(FedAvg(fraction_evaluate=1.0, min_available_nodes=1, min_evaluate_nodes=1),
                           compressor="stc")
    msgs = [train_msg(g, dst=n) for n in (41, 42, 43)]
    s._evaluate_sent = msgs  # what configure_evaluate keeps

    def ok(msg, loss, src=None):
        content = RecordDict({"metrics": MetricRecord({"num-examples": 5, "eval-loss": loss, "eval-acc": 0.9})})
        if src is None:
            return Message(content=content, reply_to=msg)
        md = Metadata(run_id=1, message_id="", src_node_id=src, dst_node_id=1,
                      reply_to_message_id=msg.metadata.message_id, group_id="1", created_at=time.time(), ttl=10.0,
                      message_type="evaluate")
        return make_message(metadata=md, content=content)

    replies = [ok(msgs[0], 0.5), ok(msgs[0], 90.0), ok(msgs[0], 90.0, src=99),
               Message(Error(2, "boom\nINFO : forged\x1b[31m"), reply_to=msgs[1]),
               Message(Error(2, "again"), reply_to=msgs[1]), _superlink_error(msgs[1], 2, "not me", src=98)]
    with caplog.at_level(logging.WARNING, logger="flwr"):
        metrics = s.aggregate_evaluate(3, replies)
    assert metrics["eval-loss"] == 0.5 and s.evaluate_history[3]["num-replies"] == 1.0
    assert s.evaluate_failure_history[3] == [
        {"node": 42, "code": 2, "error": "CLIENT_APP_RAISED_EXCEPTION", "reason": "boom\nINFO : forged\x1b[31m"},
        {"node": 43, "code": -1, "error": "NO_REPLY", "reason": NO_REPLY_REASON}]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("round 3")]
    assert lines == [
        "round 3: evaluation reply from node 41 not counted: a second reply from the same node this round "
        "(one node, one vote)",
        "round 3: evaluation reply from node 99 not counted: it was not sent a message this round (one node, one vote)",
        "round 3: client (node 42) failed to evaluate: boom\\nINFO : forged\\x1b[31m",
        f"round 3: error reply from node 98 (answering the message sent to node 42) not counted: {STRANGER_REASON}; "
        "its reason: not me",
        "round 3: client (node 43) failed to evaluate: no reply before the round's timeout"]
