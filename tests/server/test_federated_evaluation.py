"""Federated (client-side) evaluation in the default app: with ``fraction-evaluate`` the
sampled clients evaluate the global model on their own data each round, and ``metrics.json`` holds
it next to the server-side evaluation; off under DP."""

import json

import pytest
from flwr.app import Context, RecordDict

from fedcomp.app.client_app import app as client_app
from fedcomp.app.config import AppConfig
from fedcomp.app.server_app import build_inner, main
from fedcomp.run.inprocess_grid import InProcessGrid


def _run(rc, nodes):
    main(InProcessGrid(client_app, nodes, rc), Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                                                       run_config=rc))


def test_both_evaluations_are_in_metrics_json(tmp_path):
    rc = {"results-dir": str(tmp_path), "compressor": "sign", "num-server-rounds": 2, "batch-size": 64,
          "fraction-evaluate": 0.5}
    _run(rc, 4)
    rounds = json.loads((tmp_path / "metrics.json").read_text())["rounds"]
    assert "federated-accuracy" not in rounds[0]  # round 0: the initial model, server-side only
    for r in rounds[1:]:
        assert r["federated-num-replies"] == 2  # half of 4 nodes
        assert 0.0 <= r["federated-accuracy"] <= 1.0 and r["federated-loss"] > 0
        assert 0.0 <= r["accuracy"] <= 1.0  # the server-side evaluation is still there


@pytest.mark.parametrize("dp,fraction,expected", [("none", 0.5, 0.5), ("none", 0.0, 0.0), ("local", 0.5, 0.0),
                                                  ("client-level", 1.0, 0.0), ("dp-sgd", 1.0, 0.0)])
def test_the_inner_strategy_evaluates_that_fraction_of_nodes(dp, fraction, expected):
    inner = build_inner(AppConfig.from_run_config({"dp": dp, "fraction-evaluate": fraction}))
    assert inner.fraction_evaluate == expected
    assert inner.min_evaluate_nodes == (1 if expected else 0)
