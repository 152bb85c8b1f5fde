"""`flwr run . --run-config "dataset='shakespeare' model='transformer'"` end to end on the small local corpus."""

import json
import shutil

import pytest

from tests.flwr_run import flwr_run, free_ports


@pytest.mark.slow  # a real `flwr run` / SuperLink: 1-3 minutes
@pytest.mark.skipif(shutil.which("pgrep") is None, reason="needs pgrep to stop the local SuperLink")
def test_flwr_run_trains_the_transformer_on_shakespeare_roles(tmp_path, corpus):
    log, metrics_file = flwr_run(
        tmp_path, 2, "num-server-rounds=2 dataset='shakespeare' model='transformer' optimizer='adamw' lr=0.003 "
                     "batch-size=8 compressor='stc' density=0.05 precision='bf16'", free_ports(2))
    assert metrics_file.exists(), log[-3000:]
    rounds = json.loads(metrics_file.read_text())["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    counts = [(r["num-replies"], r["rejected-replies"], r["failed-clients"]) for r in rounds[1:]]
    assert counts == [(2, 0, 0)] * 2, (counts, log[-4000:])
    assert abs(rounds[0]["loss"] - 5.545) < 0.05  # a uniform guess over 256 bytes
    assert rounds[2]["loss"] < rounds[0]["loss"] - 0.1 and rounds[2]["accuracy"] > rounds[0]["accuracy"]
    dense = 2 * 164_160 * 4
    assert all(dense / 200 < r["upload-bytes"] < dense / 50 for r in rounds[1:])  # STC at 5 %: ~0.3 bit/parameter
