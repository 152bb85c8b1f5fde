"""Deployment: compose files mirror the launcher; the launcher runs a real SuperLink + SuperNodes."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from fedcomp.deploy import main as deploy_main
from fedcomp.deploy import superlink_command, supernode_command, write_connection

REPO = pathlib.Path(__file__).resolve().parents[2]


def compose(*files):
    merged: dict = {}
    for f in files:
        doc = yaml.safe_load((REPO / f).read_text())
        for name, svc in doc["services"].items():
            merged.setdefault(name, {}).update(svc)
    return merged


def test_compose_commands_equal_the_launcher():
    svc = compose("docker-compose.yml")
    assert svc["superlink"]["command"] == superlink_command(host="0.0.0.0")
    for i in range(3):
        assert svc[f"supernode-{i}"]["command"] == supernode_command(i, 3, "superlink:8000", host="0.0.0.0")
    assert svc["submit"]["command"][:5] == ["flwr", "run", ".", "local-deployment", "--stream"]
    assert "./results:/results" in svc["superlink"]["volumes"]


def test_tls_override_only_swaps_insecure_for_certificates():
    svc = compose("docker-compose.yml", "docker-compose.tls.yml")
    link = svc["superlink"]["command"]
    assert "--insecure" not in link and link[:link.index("--ssl-ca-certfile")] == superlink_command(
        host="0.0.0.0", insecure=False)
    for i in range(3):
        cmd = svc[f"supernode-{i}"]["command"]
        assert cmd[:-2] == supernode_command(i, 3, "superlink:8000", host="0.0.0.0", insecure=False)
        assert cmd[-2:] == ["--root-certificates", "/certs/ca.crt"]


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose (Debian package) not installed")
@pytest.mark.parametrize("files", [["docker-compose.yml"], ["docker-compose.yml", "docker-compose.tls.yml"]])
def test_compose_files_validate(files):
    args = [a for f in files for a in ("-f", f)]
    out = subprocess.run(["docker-compose", *args, "config", "-q"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_dockerfile_runs_as_non_root():
    text = (REPO / "Dockerfile").read_text()
    assert "\nUSER app" in text and "torch==2.13.0" in text


_PORTS = iter(range(0, 400, 100))


def _run_launcher(tmp_path, capsys, *extra):
    port = 18000 + (os.getpid() % 100) + next(_PORTS)  # a fresh port block per launcher test
    code = deploy_main(["--app", str(REPO), "--port", str(port), "--base-node-port", str(port + 1094),
                        "--workdir", str(tmp_path), "--timeout", "400", *extra])
    out = capsys.readouterr().out
    return code, out


def test_launcher_two_supernodes_two_rounds(tmp_path, capsys):
    code, out = _run_launcher(tmp_path, capsys, "--supernodes", "2", "--run-config",
                              "num-server-rounds=2 compressor='stc' density=0.05")
    data = json.loads((tmp_path / "results" / "metrics.json").read_text())
    assert code == 0, out[-2000:]
    rounds = data["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert all(r["num-replies"] == 2 and r["upload-bytes"] == r["upload-bytes-stc"] > 0 for r in rounds[1:])
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in rounds)
    # every process started was stopped
    assert subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True).stdout == b""


def test_killed_supernode_does_not_stop_the_run(tmp_path, capsys):
    code, out = _run_launcher(tmp_path, capsys, "--supernodes", "3", "--kill-supernode-after-round", "1",
                              "--run-config", "num-server-rounds=2 compressor='sign' round-timeout=45.0")
    assert "killing SuperNode 0" in out
    data = json.loads((tmp_path / "results" / "metrics.json").read_text())
    assert code == 0, out[-2000:]
    rounds = data["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert rounds[1]["num-replies"] == 3
    assert rounds[2]["num-replies"] == 2  # the dead node's reply is missing or an error, the others aggregate
    assert rounds[2]["accuracy"] > 0.0


def test_wrong_address_fails_fast_with_a_clear_message(tmp_path):
    home = tmp_path / "home"
    write_connection(home, "127.0.0.1:1")
    env = {**os.environ, "FLWR_HOME": str(home),
           "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    t0 = time.monotonic()
    out = subprocess.run(["flwr", "run", str(REPO), "local-deployment", "--stream"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert time.monotonic() - t0 < 60
    assert out.returncode != 0
    assert "unavailable" in (out.stdout + out.stderr)


def test_launcher_refuses_a_port_in_use_and_a_missing_app(tmp_path, capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        assert deploy_main(["--app", str(REPO), "--port", str(busy), "--workdir", str(tmp_path)]) == 2
        assert f"port {busy} on 127.0.0.1 is in use" in capsys.readouterr().out
    assert deploy_main(["--app", str(tmp_path), "--port", "18499", "--workdir", str(tmp_path)]) == 2
    assert "is not a Flower app" in capsys.readouterr().out


@pytest.mark.parametrize("argv,msg", [
    (["--port", "70000"], "1..65535"), (["--port", "18000", "--base-node-port", "17999", "--supernodes", "2"],
                                        "collides"),
    (["--run-config", "results-dir='/x'"], "--results-dir"), (["--workdir", "/tmp/it's"], "apostrophe"),
    (["--supernodes", "2", "--run-config", "min-available-nodes=5"], "exceeds --supernodes"),
])
def test_launcher_argument_errors(argv, msg, capsys):
    with pytest.raises(SystemExit):
        deploy_main(["--app", str(REPO), *argv])
    assert msg in capsys.readouterr().err
