"""The launchers act on their own run only: the local SuperLink of one FLWR_HOME is stopped, not that
of another; a failed launch is reported failed whatever an earlier run left in the results folder."""

import json
import subprocess
import sys
import time

import pytest

from fedcomp.run import local_deployment
from fedcomp.run.local_deployment import main as deploy_main
from fedcomp.run.local_deployment import stop_local_superlink

from .helpers import REPO, free_port_block


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_stop_local_superlink_stops_only_the_superlink_of_its_own_flwr_home(tmp_path):
    fake = tmp_path / "bin" / "flower-superlink"  # stands in for Flower's script: same name, sleeps
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")
    fake.chmod(0o755)
    procs = {}
    for home in ("flwr-home", "flwr-home-2", "flwr-home/sub"):
        log = tmp_path / home / "local-superlink" / "superlink.log"
        procs[home] = subprocess.Popen([str(fake), "--insecure", "--simulation", "--log-file", str(log)])
    try:
        time.sleep(0.5)  # let the interpreter replace the shell's argv
        assert stop_local_superlink(tmp_path / "flwr-home") == [procs["flwr-home"].pid]
        assert procs["flwr-home"].wait(10) == -15
        assert procs["flwr-home-2"].poll() is None
        assert procs["flwr-home/sub"].poll() is None
        assert stop_local_superlink(tmp_path / "elsewhere") == []
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def test_failed_launch_is_failed_despite_an_earlier_runs_metrics(tmp_path, capsys, monkeypatch):
    results = tmp_path / "results"
    results.mkdir()
    (results / "metrics.json").write_text(json.dumps({"rounds": [{"round": 0}, {"round": 3}]}))
    # the "SuperLink" is a bare interpreter: it refuses --host and exits 2 before listening
    monkeypatch.setattr(local_deployment, "_bin", lambda name: sys.executable)
    base = free_port_block(3)
    code = deploy_main(["--app", str(REPO), "--port", str(base), "--base-node-port", str(base + 1),
                        "--workdir", str(tmp_path / "work"), "--results-dir", str(results), "--timeout", "30"])
    out = capsys.readouterr().out
    assert code == 1
    assert "exited with code 2 before listening" in out
    assert f"fedcomp-deploy: FAILED; results in {results}" in out
    assert "finished" not in out and "round 3 done" not in out
