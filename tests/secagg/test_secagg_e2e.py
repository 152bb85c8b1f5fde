"""`flwr run . --run-config "secagg=true compressor='randomk' density=0.015625"` on 10 SuperNodes."""

import json
import re
import shutil

import pytest

from tests.flwr_run import flwr_run

N_PARAMS = 38282  # float entries of the default CNN


@pytest.mark.slow  # a real `flwr run` / SuperLink: 1-3 minutes
@pytest.mark.skipif(shutil.which("pgrep") is None, reason="needs pgrep to stop the local SuperLink")
def test_flwr_run_secagg_randomk_on_ten_supernodes(tmp_path):
    log, metrics_file = flwr_run(tmp_path, 10, "num-server-rounds=2 secagg=true compressor='randomk' density=0.015625",
                                 ("39401", "39403"))
    assert metrics_file.exists(), log[-3000:]
    data = json.loads(metrics_file.read_text())
    rounds = data["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2], log[-3000:]
    k = round(0.015625 * N_PARAMS)
    for r in rounds[1:]:
        assert r["num-replies"] == 10 and r["failures"] == 0 and r["k"] == k
        # 10 clients, Q = 2**16: modulus 2**20; k values + the weight entry, 20 bits each, 15-byte headers
        assert r["modulus-bits"] == 20
        assert r["upload-bytes"] == 10 * (15 + (k * 20 + 7) // 8 + 15 + 3)
        assert 0.3 < r["bits-per-parameter"] < 0.32
        assert r["secagg-protocol-bytes"] > 0
    assert data["codec"].startswith("secagg+ shared randomk")
    flower_log = (metrics_file.parent / "flower.log").read_text()  # Flower's INFO lines go there (verbose = false)
    assert flower_log.count("Secure aggregation completed") == 2
    for rnd in (0, 1, 2):
        assert len(re.findall(rf"fedcomp +{rnd} +\d\.\d{{4}} ", log)) == 1, log[-3000:]


@pytest.mark.slow  # a real `flwr run` / SuperLink: 1-3 minutes
def test_local_deployment_launcher_runs_secagg(tmp_path, capsys):
    """The same through fedcomp-local-deployment: a real SuperLink and 2 SuperNode processes, one round
    (each SecAgg+ stage is a message to every SuperNode: kept short for CI)."""
    from tests.deploy.helpers import run_launcher

    code, out = run_launcher(tmp_path, capsys, "--supernodes", "2", "--run-config",
                             "num-server-rounds=1 secagg=true compressor='randomk' density=0.015625")
    assert code == 0, out[-3000:]
    rounds = json.loads((tmp_path / "results" / "metrics.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == [0, 1]
    k = round(0.015625 * N_PARAMS)
    # 2 clients, Q = 2**16: modulus 2**18 (2 * 2**16 + 1 > 2**17)
    r = rounds[1]
    assert r["num-replies"] == 2 and r["modulus-bits"] == 18
    assert r["upload-bytes"] == 2 * (15 + (k * 18 + 7) // 8 + 15 + 3)
