"""Link speeds are bounded below by MIN_LINK_MBPS (1e-6 Mbps) in the run config, in the node config check
and on use, so a client's simulated seconds stay finite (1e-310 Mbps gave inf); a node config link speed
must be a finite number > 0."""

import math

import pytest
from flwr.app import Context, RecordDict

from fedcomp.client.mod import _link_speeds
from fedcomp.app.config import AppConfig
from fedcomp.protocol.messages import MIN_LINK_MBPS
from fedcomp.strategies.round_metrics import bounded_metrics, client_seconds, client_stats


def test_a_tiny_reported_link_speed_gives_finite_seconds():
    metrics = bounded_metrics({"uplink-mbps": 1e-310, "downlink-mbps": 1e-310, "train-seconds": 1.0})
    c = client_stats(1, metrics, upload_bytes=1000, dense_bytes=4000, decode_seconds=0.0)
    assert c["uplink-mbps"] == c["downlink-mbps"] == MIN_LINK_MBPS == 1e-6
    c["download-bytes"] = 1000.0
    secs = client_seconds(c)
    assert math.isfinite(secs) and secs == pytest.approx(1.0 + 2 * 8000 / 1.0, rel=1e-12)  # 8000 bits at 1 bit/s
    c["uplink-mbps"] = c["downlink-mbps"] = 1e-310  # a history entry written before the floor
    assert client_seconds(c) == pytest.approx(secs, rel=1e-12)


def test_link_speeds_below_the_floor_are_refused_in_configs():
    with pytest.raises(ValueError, match="uplink-mbps"):
        AppConfig.from_run_config({"uplink-mbps": 1e-310})
    with pytest.raises(ValueError, match="downlink-mbps"):
        AppConfig.from_run_config({"downlink-mbps": 1e-7})
    assert AppConfig.from_run_config({"uplink-mbps": MIN_LINK_MBPS}).uplink_mbps == MIN_LINK_MBPS
    ctx = Context(run_id=1, node_id=1, node_config={"uplink-mbps": 1e-310}, state=RecordDict(), run_config={})
    with pytest.raises(ValueError, match=r"node config 'uplink-mbps' must be a finite number > 0 .*at least 1e-06"):
        _link_speeds(ctx)


@pytest.mark.parametrize("value", [math.inf, math.nan, 0.0])
def test_a_node_config_link_speed_must_be_finite(value):
    # Per node: uplink-mbps = inf made the simulated upload time 0 instead of an error.
    import numpy as np

    from fedcomp.client import compression_mod
    from tests.messages import make_ctx, reply_with, train_msg

    g = {"w": np.zeros(10, np.float32)}
    with pytest.raises(ValueError, match="node config 'uplink-mbps' must be a finite number > 0"):
        compression_mod(train_msg(g, {"compressor": "none"}), make_ctx(node_config={"uplink-mbps": value}),
                        lambda m, c: reply_with(m, g))
