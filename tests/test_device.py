"""Clients report their machine and peak memory; the server counts machines per round (untrusted input)."""

import platform

from flwr.app import ConfigRecord
from flwr.serverapp.strategy import FedAvg

from fedcomp.client import compression_mod
from fedcomp.protocol.device import CLIENT_INFO_KEY, client_info, peak_rss_mb, reported_machine
from fedcomp.statedict import FlatModel
from fedcomp.strategies import CompressedStrategy
from fedcomp.strategies.round_metrics import machine_counts

from tests.messages import make_ctx, reply_with, train_msg, weights


def _reply(g, t, node, machine):
    msg = train_msg(g, {"compressor": "stc", "density": 0.5}, dst=node)

    def app(m, c):
        r = reply_with(m, t, n=10)
        if machine is not None:
            r.content[CLIENT_INFO_KEY] = ConfigRecord({"machine": machine})
        return r

    return compression_mod(msg, make_ctx(node_id=node), app)


def test_client_info_and_peak_rss_describe_this_process():
    info = client_info()
    assert info["machine"] == platform.machine() and info["python"] == platform.python_version()
    peak = peak_rss_mb()
    assert 10.0 < peak < 64 * 1024  # MiB: a Python process with torch loaded


def test_server_counts_machines_and_keeps_the_largest_peak_rss():
    g, t = weights(0), weights(1)
    s = CompressedStrategy(FedAvg(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1), compressor="stc")
    s.remember(1, FlatModel.from_numpy(g))
    replies = [_reply(g, t, 1, "aarch64"), _reply(g, t, 2, "x86_64"), _reply(g, t, 3, "aarch64"),
               _reply(g, t, 4, None), _reply(g, t, 5, "x" * 33)]
    peaks = [float(r.content["metrics"]["client-peak-rss-mb"]) for r in replies]
    assert all(p > 10.0 for p in peaks)
    _, _ = s.aggregate_train(1, replies)
    metrics = s.history[1]  # the round's own figures (Flower gets the headline ones)
    assert metrics["num-replies"] == 5
    assert metrics["client-peak-rss-mb"] == max(peaks)
    assert machine_counts(s.client_history[1]) == {"aarch64": 2, "unknown": 2, "x86_64": 1}


def test_reported_machine_refuses_odd_names():
    rec = {CLIENT_INFO_KEY: ConfigRecord({"machine": "arm64; rm -rf"})}

    class Content:
        config_records = rec

    assert reported_machine(Content()) is None
    Content.config_records = {CLIENT_INFO_KEY: ConfigRecord({"machine": 3})}
    assert reported_machine(Content()) is None
    Content.config_records = {}
    assert reported_machine(Content()) is None


def test_impossible_memory_reports_are_dropped_and_counted(caplog):
    import logging

    from fedcomp.strategies.round_metrics import per_client

    g, t = weights(0), weights(1)
    s = CompressedStrategy(FedAvg(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1), compressor="stc")
    s.remember(1, FlatModel.from_numpy(g))
    replies = [_reply(g, t, node, "x86_64") for node in range(1, 7)]
    honest = float(replies[0].content["metrics"]["client-peak-rss-mb"])
    lies = {2: ("client-peak-rss-mb", -5.0), 3: ("client-peak-rss-mb", 1e100), 4: ("client-memory-limit-mb", 1e100),
            5: ("client-oom-kills", 2.5), 6: ("client-peak-rss-mb", float("nan"))}
    for node, (key, value) in lies.items():
        replies[node - 1].content["metrics"][key] = value
    with caplog.at_level(logging.WARNING, logger="flwr"):
        _, _ = s.aggregate_train(1, replies)
        metrics = s.history[1]  # the round's own figures (Flower gets the headline ones)
    assert metrics["num-replies"] == 6 and metrics["dropped-device-reports"] == 5
    assert metrics["client-peak-rss-mb"] == honest
    assert per_client(s.client_history[1], "client-peak-rss-mb") == {"1": honest}
    assert "client-memory-limit-mb" not in metrics and "client-oom-kills" not in metrics  # no lie in a mean
    lines = [r.getMessage() for r in caplog.records if "memory report dropped" in r.getMessage()]
    assert lines[0] == ("round 1: node 2's memory report dropped (counted in dropped-device-reports): "
                        "client-peak-rss-mb = -5.0 is not in [0, 1073741824] MiB")
    assert len(lines) == 5


def test_implausible_memory_report_names_the_first_impossible_figure():
    from fedcomp.protocol.device import implausible_memory_report, memory_report

    assert implausible_memory_report(memory_report()) is None
    assert implausible_memory_report({}) is None
    assert implausible_memory_report({"client-peak-rss-mb": 2.0**30, "client-oom-kills": 3}) is None
    assert implausible_memory_report({"client-memory-limit-mb": float("inf")}) == (
        "client-memory-limit-mb = inf is not in [0, 1073741824] MiB")
    assert implausible_memory_report({"client-oom-kills": -1}) == (
        "client-oom-kills = -1.0 is not a whole number in [0, 2147483647]")
    assert implausible_memory_report({"client-peak-rss-mb": True}) == "client-peak-rss-mb is not a number"
