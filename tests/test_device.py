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
    _, metrics = s.aggregate_train(1, replies)
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
