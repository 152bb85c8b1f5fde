"""The default run counts both directions: the download is compressed,
the first model is a seeded start (not the dense model), and ``metrics.json`` carries the run's
bytes both ways and their ratio to fp32 both ways, round by round."""

import json

import pytest
from flwr.app import Context, RecordDict

from fedcomp.app.client_app import app as client_app
from fedcomp.app.server_app import main
from fedcomp.run.inprocess_grid import InProcessGrid
from fedcomp.task.models import build_model

MB = 1e6


def _run(tmp_path, **extra) -> list[dict]:
    rc = {"results-dir": str(tmp_path), "num-server-rounds": 3, "batch-size": 64, "fraction-evaluate": 0.0, **extra}
    main(InProcessGrid(client_app, 3, rc), Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                                                   run_config=rc))
    return json.loads((tmp_path / "metrics.json").read_text())["rounds"]


@pytest.mark.slow
def test_the_default_run_compresses_both_ways_from_the_first_model_on(tmp_path):
    rounds = _run(tmp_path)[1:]
    dense = 4 * sum(t.numel() for t in build_model().state_dict().values() if t.is_floating_point())
    assert rounds[0]["download-bytes"] < 3 * dense / 100  # 3 seeded starts: rules, not the model
    assert all(r["download-bytes"] < 3 * dense / 10 for r in rounds)  # STC 5 %: positions and signs
    up = down = fp32 = 0.0
    for r in rounds:  # the run's totals are what travelled: every message serialised, both ways
        assert r["wire-bytes-up"] > r["upload-bytes"] and r["wire-bytes-down"] > r["download-bytes"]
        up, down, fp32 = up + r["wire-bytes-up"], down + r["wire-bytes-down"], fp32 + r["wire-bytes-fp32"]
        assert r["cumulative-mb"] == pytest.approx((up + down) / MB, rel=1e-12)
        assert r["cumulative-ratio-both-ways"] == pytest.approx(fp32 / (up + down), rel=1e-12)
    assert rounds[-1]["cumulative-ratio-both-ways"] > 50


@pytest.mark.slow
def test_fp32_is_fp32_both_ways_and_its_ratio_is_one(tmp_path):
    rounds = _run(tmp_path, compressor="none")[1:]
    assert all(r["cumulative-ratio-both-ways"] == pytest.approx(1.0, abs=0.01) for r in rounds)


def test_the_correction_auto_chose_is_said_once_and_only_when_on(tmp_path, caplog):
    """Found by a new user: with optimizer adamw, downstream-correction = 'auto' turned the correction
    on and nothing in the run's output said so. One INFO line now names it; the default run (SGD, auto
    off) prints no such line."""
    import logging

    caplog.set_level(logging.INFO, logger="flwr")
    _run(tmp_path / "adamw", **{"optimizer": "adamw", "lr": 0.003, "num-server-rounds": 1})
    said = [r.getMessage() for r in caplog.records if "downstream-correction" in r.getMessage()]
    assert said == ["fedcomp  downstream-correction 'auto' chose on (optimizer 'adamw', downstream stc): each update "
                    "is counted from the global model, not the client's compressed copy; set it to \"off\" to fold "
                    "them as they came"]
    caplog.clear()
    _run(tmp_path / "sgd", **{"num-server-rounds": 1})
    assert not [r for r in caplog.records if "downstream-correction" in r.getMessage()]
