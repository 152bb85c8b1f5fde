"""Shaped links: ``benchmarks/netshape.py`` really limits each direction to its
rate, and ``benchmarks/links.py`` reads the logs of a run right. Shaping needs root, ``ip`` and
``tc``; those tests skip where a network namespace with a tbf qdisc cannot be made."""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import links
import netshape

REASON = netshape.unavailable()
needs_shaping = pytest.mark.skipif(REASON is not None, reason=f"shaped links: {REASON}")


def _time_transfer(topo, nbytes: int, upload: bool) -> float:
    """Seconds to move ``nbytes`` over TCP between namespace 0 and the bridge (receiver's clock,
    from accept/connect to EOF); ``upload``: the namespace sends."""
    with socket.socket() as srv:
        srv.bind((topo.host_ip, 0))
        srv.listen(1)
        srv.settimeout(60)
        port = srv.getsockname()[1]
        if upload:
            code = (f"import socket; s = socket.create_connection(('{topo.host_ip}', {port}), timeout=60); "
                    f"s.sendall(b'x' * {nbytes}); s.close()")
            p = subprocess.Popen([*topo.exec_prefix(0), sys.executable, "-c", code])
            conn, _ = srv.accept()
            t0, got = time.monotonic(), 0
            with conn:
                conn.settimeout(60)
                while chunk := conn.recv(65536):
                    got += len(chunk)
            secs = time.monotonic() - t0
        else:
            code = (f"import socket, time; s = socket.create_connection(('{topo.host_ip}', {port}), timeout=60)\n"
                    "t0, got = time.monotonic(), 0\n"
                    "while chunk := s.recv(65536):\n    got += len(chunk)\n"
                    "print(got, time.monotonic() - t0)")
            p = subprocess.Popen([*topo.exec_prefix(0), sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
            conn, _ = srv.accept()
            with conn:
                conn.sendall(b"x" * nbytes)
            got, secs = p.communicate(timeout=60)[0].split()
            got, secs = int(got), float(secs)
        assert p.wait(60) == 0 and got == nbytes
    return secs


@pytest.mark.slow
@needs_shaping
def test_tbf_rates_hold_in_each_direction_and_everything_is_removed():
    with netshape.Topology(1, up_mbps=1.0, down_mbps=10.0) as topo:
        ns = topo.namespaces[0]
        # 250 kB = 2.0 Mbit: 2.0 s at 1 Mbit/s up; 2.5 MB = 20 Mbit: 2.0 s at 10 Mbit/s down
        # (tc counts Ethernet/IP/TCP headers too: about 4.6 % more at MTU 1500)
        assert _time_transfer(topo, 250_000, upload=True) == pytest.approx(2.0, rel=0.2)
        assert _time_transfer(topo, 2_500_000, upload=False) == pytest.approx(2.0, rel=0.2)
        stats = topo.qdisc_stats()
        assert "rate 1Mbit" in stats["up-0"] and "rate 10Mbit" in stats["down-0"]
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    assert ns not in left
    assert topo.tag not in subprocess.run(["ip", "link"], capture_output=True, text=True, check=False).stdout


def test_tbf_arguments():
    assert netshape.tbf_args(1.0) == ["tbf", "rate", "1000000bit", "burst", "3200", "latency", "200ms"]
    assert netshape.tbf_args(100.0) == ["tbf", "rate", "100000000bit", "burst", "62500", "latency", "200ms"]
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="link speed must be > 0"):
            netshape.tbf_args(bad)


def _stamped(tmp_path, name, lines):
    path = tmp_path / name
    path.write_text("".join(f"{t:.3f} {text}\n" for t, text in lines))
    return path


def test_node_messages_and_breakdown_from_logs(tmp_path):
    node = _stamped(tmp_path, "supernode-0.log", [
        (100.0, "INFO :      Starting Flower SuperNode"),
        (101.0, "INFO :      Receiving: train message (ID: ab)"),
        (102.5, "INFO :      Received successfully"),
        (103.0, "INFO :      Start `flwr-clientapp` process"),
        (120.0, "INFO :      Sending: train message (ID: cd)"),
        (122.0, "INFO :      Sent successfully"),
    ])
    msgs = links.node_messages(node)
    assert msgs == [{"type": "train", "t-receiving": 101.0, "t-received": 102.5, "t-clientapp": 103.0,
                     "t-sending": 120.0, "t-sent": 122.0}]
    import datetime

    def stamp(t):
        return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S,") + f"{round(t % 1 * 1000):03d}"

    flower = tmp_path / "flower.log"
    flower.write_text(f"INFO {stamp(99.0)} [ROUND 1/3]\nINFO {stamp(100.0)} configure_train: Sampled 1 nodes\n"
                      f"INFO {stamp(122.5)} \t└──> Aggregated MetricRecord: {{'train-seconds': 9.0}}\n")
    phases = links.server_train_phases(flower)
    assert phases[1] == pytest.approx((100.0, 122.5), abs=1e-3)
    rounds = [{"round": 1, "upload-bytes": 125_000.0, "download-bytes": 1_250_000.0, "num-replies": 1,
               "train-seconds-max": 9.0, "compress-seconds": 1.0, "clientapp-seconds-max": 16.0,
               "round-seconds-simulated": 18.0}]
    (b,) = links.round_breakdown(rounds, phases, [msgs], up=1.0, down=10.0)
    assert b["phase"] == pytest.approx(22.5, abs=1e-3) and b["poll"] == pytest.approx(1.0, abs=1e-3)
    assert b["download"] == pytest.approx(1.5) and b["upload"] == pytest.approx(2.0)
    assert b["clientapp"] == pytest.approx(17.5) and b["pickup"] == pytest.approx(0.5, abs=1e-3)
    assert b["upload-computed"] == pytest.approx(1.0) and b["download-computed"] == pytest.approx(1.0)
    # a second round like the first; round 1 (app bundle download) stays out of the link part
    row = {"measured-seconds": 46.0, "rounds-to-target": 2, "rounds-run": 2, "uplink-mbps": 1.0,
           "rounds": [*rounds, {**rounds[0], "round": 2}], "breakdown": [b, {**b, "round": 2}], "codec": "fp32"}
    # the run's metrics predate the polling term: the model now adds 3 s a round
    assert links.current_model_seconds(row) == pytest.approx(2 * (18.0 + 3.0))
    c = links.compare(row, floor=0.5)
    assert c["ratio"] == pytest.approx(46 / 42) and c["old"] == pytest.approx(2 * 12.0)
    assert c["link-measured"] == pytest.approx(3.5 - 0.5) and c["link-computed"] == pytest.approx(2.0)
    assert c["ratio-link"] == pytest.approx(3.0 / 2.0)
    assert links.link_floor([row], "fp32") == pytest.approx(3.5 - 2.0)
    assert "| fp32 | 1 / 10 | 2 | 46.0 | 42.0 | 1.10 | 24.0 | 1.92 |" in links.table(
        [{**row, "downlink-mbps": 10.0}])


@pytest.mark.slow
@needs_shaping
def test_links_quick_runs_a_shaped_deployment(tmp_path):
    """--quick: fp32 at 10/100 Mbit/s for 2 rounds of a real SuperLink + 2 SuperNodes in namespaces,
    written to $TMPDIR, never over the committed results."""
    ref = (REPO / "benchmarks" / "results" / "links.json")
    before = ref.read_bytes() if ref.exists() else None
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "links.py"), "--quick"], env=env, check=False,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads((tmp_path / "fedcomp-benchmarks" / "links.json").read_text())
    (row,) = res["rows"]
    assert row["codec"] == "fp32" and row["uplink-mbps"] == 10.0 and row["downlink-mbps"] == 100.0
    assert row["rounds-run"] == 2 and len(row["breakdown"]) == 2
    for b in row["breakdown"]:
        # the ClientApp process's life (reported) covers its training, and the SuperNode saw it
        assert 0 < b["compute-reported"] < b["clientapp-reported"] <= b["clientapp"] + 1.0
        assert b["upload"] > 0 and b["download"] > 0
        assert b["upload-computed"] == pytest.approx(153_336 * 8 / 10e6, rel=0.01)  # fp32 CNN payloads
    assert (ref.read_bytes() if ref.exists() else None) == before
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    assert row["netns-tag"] not in left


def test_relay_adds_the_round_trip_time_and_keeps_the_bytes():
    """netshape.relay (the RTT where tc's netem is missing): a request/response exchange through it
    takes one RTT more, and 1 MB crosses it unchanged in both directions."""
    import threading

    def echo(srv):
        conn, _ = srv.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    with socket.socket() as srv, socket.socket() as probe:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        probe.bind(("127.0.0.1", 0))
        relay_port = probe.getsockname()[1]
        probe.close()
        threading.Thread(target=echo, args=(srv,), daemon=True).start()
        relay = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "netshape.py"), "relay", str(relay_port),
                                  "127.0.0.1", str(srv.getsockname()[1]), "200"])
        try:
            deadline = time.monotonic() + 60
            while True:  # bounded: until the relay listens or 60 s
                try:
                    conn = socket.create_connection(("127.0.0.1", relay_port), timeout=60)
                    break
                except OSError:
                    assert time.monotonic() < deadline and relay.poll() is None
                    time.sleep(0.1)
            with conn:
                times = []
                for _ in range(3):
                    t0 = time.monotonic()
                    conn.sendall(b"ping")
                    assert conn.recv(16) == b"ping"
                    times.append(time.monotonic() - t0)
                assert 0.2 <= min(times) < 0.2 + 0.3
                blob = os.urandom(1_000_000)
                sender = threading.Thread(target=conn.sendall, args=(blob,))
                sender.start()
                got = bytearray()
                while len(got) < len(blob):
                    got += conn.recv(65536)
                sender.join(60)
                assert bytes(got) == blob
        finally:
            relay.terminate()
            relay.wait(30)


@needs_shaping
def test_a_name_clash_removes_nothing_it_did_not_create(monkeypatch):
    """A namespace or bridge that already exists under the probe's / topology's name is someone else's:
    the failed build must leave it in place."""
    monkeypatch.setattr(netshape.secrets, "token_hex", lambda n: "d" * (2 * n))
    theirs_ns, theirs_br = "fcp" + "d" * 8, "fcl" + "d" * 8 + "br"
    subprocess.run(["ip", "netns", "add", theirs_ns], check=True)
    subprocess.run(["ip", "link", "add", theirs_br, "type", "bridge"], check=True)
    try:
        assert "File exists" in (netshape.unavailable() or "")
        with pytest.raises(subprocess.CalledProcessError):
            netshape.Topology(1, 1.0, 10.0)
        assert theirs_ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert subprocess.run(["ip", "link", "show", theirs_br], capture_output=True).returncode == 0
    finally:
        subprocess.run(["ip", "link", "del", theirs_br], check=False)
        subprocess.run(["ip", "netns", "del", theirs_ns], check=False)
