"""A ClientApp process killed by SIGKILL (what the kernel's out-of-memory killer does; exit code 137
in a container) on a real SuperLink + SuperNodes: the server names the node and the reason in its
log and in metrics.json, and the round goes on with the other client (not a silent dropout)."""

import json
import os
import pathlib
import re
import subprocess

import pytest

from fedcomp.run.local_deployment import main as deploy_main
from fedcomp.strategies.failures import CRASHED_REASON

from .helpers import free_port_block

REPO = pathlib.Path(__file__).resolve().parents[2]

# fedcomp's ClientApp behind a mod that SIGKILLs its own process on partition 0's round-1 train message
KILLER = '''
import os, signal
from flwr.clientapp import ClientApp
from fedcomp.app.client_app import evaluate_handler, train_handler
from fedcomp.client.mod import compression_mod
from fedcomp.secagg.client import secagg_mod

def sigkill_mod(msg, context, call_next):
    if (msg.metadata.message_type == "train" and context.node_config["partition-id"] == 0
            and msg.content["config"]["server-round"] == 1):
        os.kill(os.getpid(), signal.SIGKILL)
    return call_next(msg, context)

app = ClientApp(mods=[sigkill_mod, secagg_mod, compression_mod])
app.train()(train_handler)
app.evaluate()(evaluate_handler)
'''


@pytest.mark.slow
def test_sigkilled_clientapp_is_a_named_failure(tmp_path, capsys, monkeypatch):
    app = tmp_path / "app"
    app.mkdir()
    (app / "killer.py").write_text(KILLER)
    # an app of its own (killer.py, fedcomp installed): our bundle rule names fedcomp/, which Flower
    # refuses where it matches nothing, so this app drops it
    (app / "pyproject.toml").write_text("\n".join(
        line for line in (REPO / "pyproject.toml").read_text().replace(
            'clientapp = "fedcomp_app.client_app:app"', 'clientapp = "killer:app"').splitlines()
        if not line.startswith("fab-include")) + "\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    base = free_port_block(3)
    code = deploy_main(["--app", str(app), "--port", str(base), "--base-node-port", str(base + 1), "--workdir",
                        str(tmp_path / "work"), "--timeout", "500", "--supernodes", "2", "--run-config",
                        "num-server-rounds=2 compressor='stc' fraction-evaluate=0.0"])
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    rounds = json.loads((tmp_path / "work" / "results" / "metrics.json").read_text())["rounds"]
    r1, r2 = rounds[1], rounds[2]
    assert r1["num-replies"] == 1 and r1["failed-clients"] == 1 and r2["num-replies"] == 2 and r2["failures"] == []
    killed = int((set(r2["client-peak-rss"]) - set(r1["client-peak-rss"])).pop())  # back in round 2
    # each client's own peak RSS by node id (MiB: a process with torch loaded); no container limit here
    assert len(r2["client-peak-rss"]) == 2 and all(100 < v < 4096 for v in r2["client-peak-rss"].values())
    assert r2["client-peak-rss-mb"] == max(r2["client-peak-rss"].values())
    assert r1["failures"] == [{"node": killed, "code": 8, "error": "CLIENT_APP_CRASHED",
                               "reason": f"{CRASHED_REASON} (Flower: 'ClientApp stopped responding.')"}]
    assert re.search(rf"round 1: client \(node {killed}\) failed: the ClientApp process ended without replying: "
                     r"killed by a signal \(SIGKILL, exit code 137 in a container\) — likely out of memory", out)
    assert subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, check=False).stdout == b""
