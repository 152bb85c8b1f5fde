"""Hostile numbers a client reports (each with the right value): an unknown extra metric, a bad
num-examples, non-finite metrics (dropped; results files stay strict JSON)."""

import json
import math

import numpy as np
import pytest
from flwr.app import MetricRecord

from fedcomp.strategies import CompressedStrategy
from tests.messages import weights

from .helpers import compressed_reply, fedavg, setup


def _set_metrics(reply, **kv):
    m = dict(reply.content["metrics"])
    m.update(kv)
    reply.content["metrics"] = MetricRecord(m)
    return reply


def test_a_client_with_an_extra_metric_does_not_abort_the_round():
    g, t1, t2 = weights(0), weights(1), weights(2)
    s = CompressedStrategy(fedavg(), compressor="none")
    setup(s, g)
    arrays, m = s.aggregate_train(1, [compressed_reply(g, t1, 1, n=10),
                                      _set_metrics(compressed_reply(g, t2, 2, n=30), foo=1.0)])
    assert m["num-replies"] == 2 and "foo" not in m
    assert np.allclose(arrays["w"].numpy(), (10 * t1["w"] + 30 * t2["w"]) / 40, atol=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -9, 0, 2.5, 1e30, [1, 2]])
def test_bad_num_examples_is_rejected(bad):
    g, t1, t2 = weights(0), weights(1), weights(2)
    s = CompressedStrategy(fedavg(), compressor="none")
    setup(s, g)
    arrays, m = s.aggregate_train(1, [compressed_reply(g, t1, 1, n=10),
                                      _set_metrics(compressed_reply(g, t2, 2), **{"num-examples": bad})])
    m = s.history[1]
    assert m["rejected-replies"] == 1 and m["num-replies"] == 1
    assert np.allclose(arrays["w"].numpy(), t1["w"], atol=1e-6)


def test_non_finite_client_metrics_are_dropped_and_results_are_strict_json(tmp_path):
    from fedcomp.app.results import write_json

    g, t = weights(0), weights(1)
    s = CompressedStrategy(fedavg(), compressor="none")
    setup(s, g)
    _, _ = s.aggregate_train(1, [_set_metrics(compressed_reply(g, t, 1), **{"train-loss": float("inf")})])
    m = s.history[1]  # the round's own figures (Flower gets the headline ones)
    assert all(math.isfinite(v) for v in m.values() if isinstance(v, float))
    write_json(tmp_path / "m.json", {"a": float("nan"), "b": [1.0, float("inf")]})
    assert json.loads((tmp_path / "m.json").read_text()) == {"a": None, "b": [1.0, None]}


def test_flowers_record_holds_no_headline_figure_that_the_wrapper_did_not_compute():
    """``epsilon``/``epsilon-max`` in Flower's round record are the wrapper's figures: clients reporting
    them (every client, so the common-keys trim keeps them) in a run without DP do not plant a privacy
    figure there, and DP-SGD clients' own ``epsilon`` is not averaged into one (its max is the figure)."""
    g, t1, t2 = weights(0), weights(1), weights(2)
    planted = {"epsilon": 0.1, "epsilon-max": 0.2}
    s = CompressedStrategy(fedavg(), compressor="none")
    setup(s, g)
    _, m = s.aggregate_train(1, [compressed_reply(g, t1, 1, n=10, metrics={"epsilon-max": 0.2, "train-acc": 0.5}),
                                 compressed_reply(g, t2, 2, n=30, metrics={"epsilon-max": 0.2, "train-acc": 0.9})])
    assert "epsilon-max" not in m and "epsilon" not in m and m["train-acc"] == pytest.approx(0.8)
    s = CompressedStrategy(fedavg(), compressor="none")  # DP-SGD clients report their own epsilon
    setup(s, g)
    _, m = s.aggregate_train(1, [compressed_reply(g, t1, 1, n=10, metrics={**planted, "epsilon": 1.0}),
                                 compressed_reply(g, t2, 2, n=30, metrics={**planted, "epsilon": 3.0})])
    assert "epsilon" not in m and m["epsilon-max"] == 3.0 == s.history[1]["epsilon-max"]
