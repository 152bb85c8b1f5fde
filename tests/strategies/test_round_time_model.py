"""The simulated round time counts a per-message ClientApp process's life (with shaped links, a round
time without it is under half of the measured wall clock)."""

import math
import os
import pathlib
import subprocess
import sys

import pytest

from fedcomp.protocol.device import CLIENTAPP_PROCESS, clientapp_seconds
from fedcomp.strategies.round_metrics import FLOWER_POLL_SECONDS, client_seconds, client_stats, round_metrics

REPO = pathlib.Path(__file__).resolve().parents[2]


def stats(node, train, clientapp, up_bytes, down_bytes, up=1.0, down=10.0):
    metrics = {"train-seconds": train, "compress-seconds": 0.5, "clientapp-seconds": clientapp,
               "uplink-mbps": up, "downlink-mbps": down, "download-bytes": down_bytes}
    return client_stats(node, metrics, upload_bytes=up_bytes, dense_bytes=4 * up_bytes, decode_seconds=0.0)


def test_the_clientapp_process_life_replaces_compute_when_longer():
    c = stats(1, train=10.0, clientapp=30.0, up_bytes=125_000, down_bytes=1_250_000)
    assert c["clientapp-seconds"] == 30.0
    # 125 kB at 1 Mbit/s = 1 s up, 1.25 MB at 10 Mbit/s = 1 s down
    assert client_seconds(c) == pytest.approx(30.0 + 1.0 + 1.0, rel=1e-12)
    c = stats(1, train=10.0, clientapp=5.0, up_bytes=125_000, down_bytes=1_250_000)
    assert client_seconds(c) == pytest.approx(10.5 + 2.0, rel=1e-12)  # train + compress is larger
    c = stats(1, train=10.0, clientapp=0.0, up_bytes=125_000, down_bytes=1_250_000)  # simulation: 0
    assert client_seconds(c) == pytest.approx(12.5, rel=1e-12)


def test_round_time_is_the_slowest_client_with_its_process_life():
    a = stats(1, train=10.0, clientapp=30.0, up_bytes=125_000, down_bytes=1_250_000)
    b = stats(2, train=20.0, clientapp=21.0, up_bytes=250_000, down_bytes=1_250_000)
    out = round_metrics([a, b], {}, n_good=2, rejected=0, failed=0)
    # deployed (per-message ClientApp processes): Flower's polling, 1.5 s + 1.5 s on average, on top
    assert FLOWER_POLL_SECONDS == out["round-poll-seconds"] == 3.0
    assert out["round-seconds-simulated"] == pytest.approx(max(30.0 + 2.0, 21.0 + 2.0 + 1.0) + 3.0, rel=1e-12)
    assert out["clientapp-seconds-max"] == 30.0


def test_no_polling_term_without_per_message_processes():
    """Simulation and in-process runs: clients report clientapp-seconds 0, the round is as before."""
    a = stats(1, train=10.0, clientapp=0.0, up_bytes=125_000, down_bytes=1_250_000)
    b = stats(2, train=20.0, clientapp=0.0, up_bytes=250_000, down_bytes=1_250_000)
    out = round_metrics([a, b], {}, n_good=2, rejected=0, failed=0)
    assert out["round-poll-seconds"] == 0.0
    assert out["round-seconds-simulated"] == pytest.approx(20.5 + 2.0 + 1.0, rel=1e-12)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -5.0, "30", True])
def test_hostile_clientapp_seconds_count_as_zero(bad):
    c = stats(1, train=10.0, clientapp=bad, up_bytes=125_000, down_bytes=0)
    assert c["clientapp-seconds"] == 0.0
    assert math.isfinite(client_seconds(c)) and client_seconds(c) == pytest.approx(11.5, rel=1e-12)


def test_a_history_entry_without_the_key_keeps_the_old_model():
    c = stats(1, train=10.0, clientapp=30.0, up_bytes=125_000, down_bytes=0)
    del c["clientapp-seconds"]  # written by an older server (checkpoint)
    assert client_seconds(c) == pytest.approx(11.5, rel=1e-12)


def test_clientapp_seconds_is_zero_outside_a_per_message_process():
    assert os.path.basename(sys.argv[0]) != CLIENTAPP_PROCESS
    assert clientapp_seconds() == 0.0


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
def test_clientapp_seconds_is_the_process_age_in_a_flwr_clientapp_process():
    code = ("import sys, time; time.sleep(1.0); sys.argv[0] = '/venv/bin/flwr-clientapp'; "
            "from fedcomp.protocol.device import clientapp_seconds; print(clientapp_seconds())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    age = float(out.stdout)
    assert 1.0 <= age < 60.0  # slept 1 s after start; the interpreter's start on a busy machine on top
