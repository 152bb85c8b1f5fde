"""End to end: the in-process federation, and a real `flwr run .` local simulation."""

import json
import pathlib
import re
import shutil
import sys

import pytest

from tests.flwr_run import fedcomp_run, flwr_run

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_in_process_federation_learns_and_counts_bytes():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from federated import run_one

    rounds = run_one({"num-server-rounds": 6, "compressor": "stc", "density": 0.05, "lr": 0.1, "seed": 1}, 3)
    acc = [r["accuracy"] for r in rounds]
    assert len(rounds) == 7 and rounds[0]["round"] == 0
    assert max(acc[-2:]) > acc[0] + 0.15
    for r in rounds[1:]:
        assert r["num-replies"] == 3 and r["rejected-replies"] == 0
        assert r["upload-bytes"] == r["upload-bytes-stc"]
        assert 20 < r["compression-ratio"] < 200


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("pgrep") is None, reason="needs pgrep to stop the local SuperLink")
def test_flwr_run_local_simulation(tmp_path):
    log, metrics_file, code = fedcomp_run(tmp_path, 3, "num-server-rounds=2 compressor='sign' lr=0.1",
                                          ("39391", "39393"), wrapper=True)
    assert code == 0, log[-3000:]  # fedcomp-simulation: 0 only when the run wrote its results
    results = metrics_file.parent
    assert metrics_file.exists(), log[-3000:]
    data = json.loads(metrics_file.read_text())
    rounds = data["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert all(r["num-replies"] == 3 for r in rounds[1:])
    # federated evaluation (fraction-evaluate 0.5 of 3 nodes: 1) next to the server-side one
    assert all(r["federated-num-replies"] == 1 and 0 <= r["federated-accuracy"] <= 1 for r in rounds[1:])
    n_params = 38282
    for r in rounds[1:]:
        # sign: 1 bit/param + per-tensor headers and scales, 3 clients
        assert 3 * n_params / 8 < r["upload-bytes"] < 3 * (n_params / 8 + 8 * 60)
    assert (results / "plot.png").stat().st_size > 1000
    assert "fedcomp  results written to" in log
    # each round line once, no DEBUG lines (Opacus' logging.basicConfig at import doubled every line)
    for rnd in (0, 1, 2):
        assert len(re.findall(rf"fedcomp +{rnd} +\d\.\d{{4}} ", log)) == 1, log[-3000:]
    assert "DEBUG" not in log
    # one line per round, so 50 rounds read as a table: the table, the final two lines and Flower's
    # start-up/shut-down lines, none of Flower's per-round lines or "Final results"
    lines = [ln for ln in log.splitlines() if ln.strip()]
    ours = [ln for ln in lines if "fedcomp  " in ln]
    # header, rounds 0-2, final accuracy, results written to (and, where 2 rounds left it at chance, the line
    # saying so: this run's accuracy after 2 rounds is 0.10-0.11)
    near_chance = sum("the run ended near chance" in ln for ln in ours)
    assert near_chance == (rounds[-1]["accuracy"] <= 0.1028 + 0.05), log[-3000:]
    assert len(ours) == 1 + 3 + 2 + near_chance, log[-3000:]
    assert len(lines) - len(ours) <= 16, log[-3000:]
    assert "[ROUND" not in log and "Final results" not in log and "Aggregated MetricRecord" not in log
    kept = (results / "flower.log").read_text()
    assert "[ROUND 2/2]" in kept and "Final results" in kept and "Aggregated MetricRecord" in kept


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("pgrep") is None, reason="needs pgrep to stop the local SuperLink")
def test_flwr_run_trains_the_batchnorm_resnet(tmp_path):
    """`flwr run . --run-config "model='resnet'"` end to end (BatchNorm, int64 num_batches_tracked)."""
    log, metrics_file = flwr_run(tmp_path, 2, "num-server-rounds=3 model='resnet' compressor='stc' density=0.05",
                                 ("39395", "39397"))
    assert metrics_file.exists(), log[-3000:]
    rounds = json.loads(metrics_file.read_text())["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    assert all(r["num-replies"] == 2 and r["rejected-replies"] == 0 and r["failed-clients"] == 0 for r in rounds[1:])
    assert max(r["accuracy"] for r in rounds[1:]) > rounds[0]["accuracy"] + 0.1
    assert all(r["upload-bytes-exact"] > 0 for r in rounds[1:])  # num_batches_tracked travel exactly


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("pgrep") is None, reason="needs pgrep to stop the local SuperLink")
def test_flwr_run_with_a_bad_value_prints_one_error_line(tmp_path):
    """A bad run-config value under plain `flwr run`: fedcomp's one line, not also Flower's 5-line
    "Exit Code: 700 / An unhandled exception occurred ..." block after it (`flwr run` still exits 0)."""
    log, metrics_file = flwr_run(tmp_path, 2, "density=1.5", ("39791", "39793"))
    assert not metrics_file.exists()
    errors = [re.sub(r"\x1b\[[0-9;]*m", "", ln) for ln in log.splitlines() if "ERROR" in ln]
    assert errors == [("ERROR :     fedcomp  run config 'density' must be in (0.0, 1.0], got 1.5 (the run stopped; "
                       "`flwr run` still exits 0)")], log[-3000:]
    assert "Exit Code" not in log and "unhandled exception" not in log and "Traceback" not in log, log[-3000:]
