"""Attack-round fix (F16): a link speed of 1e-310 Mbps made a client's simulated seconds inf; link
speeds are bounded below by MIN_LINK_MBPS (1e-6 Mbps) in the config, the node check, and on use."""

import math

import pytest
from flwr.app import Context, RecordDict

from fedcomp.client.mod import _link_speeds
from fedcomp.config import AppConfig
from fedcomp.protocol import MIN_LINK_MBPS
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
