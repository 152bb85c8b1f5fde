"""SuperNode authentication with real processes on 127.0.0.1: a TLS SuperLink with
``--enable-supernode-auth``, two SuperNodes whose public keys are registered and one whose key
is not. The unlisted one is refused and trains nothing; the listed ones finish the run."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

from fedcomp.run.local_deployment import Processes, superlink_command, supernode_command, wait_for_port

from .helpers import free_port_block

REPO = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(shutil.which("ssh-keygen") is None or shutil.which("openssl") is None,
                                 reason="needs ssh-keygen and openssl to make keys and certificates")]


def _bin(name: str) -> str:
    return str(pathlib.Path(sys.executable).parent / name)


def test_only_registered_supernodes_join(tmp_path):
    subprocess.run(["bash", str(REPO / "scripts" / "generate_certs.sh"), str(tmp_path / "certs")], check=True,
                   capture_output=True)
    subprocess.run(["bash", str(REPO / "scripts" / "generate_supernode_keys.sh"), str(tmp_path / "keys"), "3"],
                   check=True, capture_output=True)
    certs, keys, results = tmp_path / "certs", tmp_path / "keys", tmp_path / "results"
    base = free_port_block(4)
    home = tmp_path / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "auth"\n\n[superlink.auth]\naddress = "127.0.0.1:{base}"\n'
        f'root-certificates = "{certs / "ca.crt"}"\n')
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    procs = Processes()
    try:
        link_cmd = superlink_command(port=base, insecure=False) + [
            "--ssl-ca-certfile", str(certs / "ca.crt"), "--ssl-certfile", str(certs / "server.crt"),
            "--ssl-keyfile", str(certs / "server.key"), "--enable-supernode-auth"]
        link = procs.start([_bin(link_cmd[0]), *link_cmd[1:]], env, tmp_path / "superlink.log")
        wait_for_port("127.0.0.1", base, link, timeout=60)
        for i in (0, 1):  # the list: supernode-2's key is not on it
            reg = subprocess.run([_bin("flwr"), "supernode", "register", str(keys / f"supernode-{i}.pub"), "auth"],
                                 env=env, capture_output=True, text=True, timeout=60)
            assert "registered successfully" in reg.stdout, reg.stdout + reg.stderr
        nodes = []
        for i in range(3):
            cmd = supernode_command(i, 3, f"127.0.0.1:{base}", base + 1, insecure=False) + [
                "--root-certificates", str(certs / "ca.crt"), "--auth-supernode-private-key",
                str(keys / f"supernode-{i}")]
            nodes.append(procs.start([_bin(cmd[0]), *cmd[1:]], env, tmp_path / f"supernode-{i}.log"))
        # the unlisted SuperNode is refused at once and exits
        deadline = time.monotonic() + 90
        while nodes[2].poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        refused = (tmp_path / "supernode-2.log").read_text()
        assert nodes[2].returncode not in (None, 0), refused[-2000:]
        assert "Failed to activate SuperNode" in refused
        run = subprocess.run(
            [_bin("flwr"), "run", str(REPO), "auth", "--stream", "--run-config",
             f"num-server-rounds=2 compressor='sign' min-available-nodes=2 min-train-nodes=2 results-dir='{results}'"],
            env=env, capture_output=True, text=True, timeout=400)
        assert nodes[0].poll() is None and nodes[1].poll() is None  # the listed ones are still serving
    finally:
        procs.stop_all()
    log = run.stdout + run.stderr
    # `flwr run` exits 0 even on a failed run: judge by the results
    rounds = json.loads((results / "metrics.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2], log[-3000:]
    assert all(r["num-replies"] == 2 and r["failed-clients"] == 0 for r in rounds[1:])
    # the refused node never received a task
    assert "Receiving: train message" not in refused
    assert "fedcomp  results written to" in log
