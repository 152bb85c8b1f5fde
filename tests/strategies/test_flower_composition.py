"""compression_mod / CompressedStrategy composed with Flower's own mods and strategies.

Right: ``ClientApp(mods=[compression_mod])`` + ``@app.train(mods=[fixedclipping_mod])`` (Flower's
DP mods per train handler: registered globally they also see evaluate messages, which carry no
``clipping_norm``, and fail them), server ``CompressedStrategy(DifferentialPrivacyClientSide
FixedClipping(FedAvg))``; robust aggregators (FedMedian, FedTrimmedAvg) as inner strategy.
Wrong: our mod inside Flower's clipping mod, and a plain FedAvg receiving payloads; these tests
pin down what happens today.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import fixedclipping_mod
from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping, FedAvg, FedMedian, FedTrimmedAvg

from fedcomp.client import compression_mod
from fedcomp.run.inprocess_grid import InProcessGrid
from fedcomp.strategies import CompressedStrategy

N = 3
CLIP = 1.0


def initial() -> ArrayRecord:
    rng = np.random.default_rng(0)
    return ArrayRecord({"w": Array(rng.standard_normal((8, 4)).astype(np.float32)),
                        "b": Array(rng.standard_normal(4).astype(np.float32))})


def big_step_train(msg: Message, context: Context) -> Message:
    """A 'training' step whose update has norm about 10 (so that clipping at 1.0 bites)."""
    pid = int(context.node_config["partition-id"])
    rng = np.random.default_rng(pid)
    arrays = {k: a.numpy() + 3.0 * rng.standard_normal(a.numpy().shape).astype(np.float32)
              for k, a in msg.content["arrays"].items()}
    content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                          "metrics": MetricRecord({"num-examples": 10})})
    return Message(content=content, reply_to=msg)


def evaluate(msg: Message, context: Context) -> Message:
    return Message(content=RecordDict({"metrics": MetricRecord({"num-examples": 10, "eval-loss": 1.0})}),
                   reply_to=msg)


def _train_msg() -> Message:
    from tests.messages import make_msg

    return make_msg(RecordDict({"arrays": initial(), "config": ConfigRecord()}))


def _ctx(pid: int) -> Context:
    return Context(run_id=1, node_id=pid, node_config={"partition-id": pid}, state=RecordDict(), run_config={})


def client_app(global_mods, train_mods) -> ClientApp:
    app = ClientApp(mods=global_mods)
    app.train(mods=train_mods)(big_step_train)
    app.evaluate()(evaluate)
    return app


class RecordingFedAvg(FedAvg):
    """FedAvg that keeps the update norms (reply - global) of the dense replies it aggregates."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.norms: dict[int, list[float]] = {}
        self.sent: dict[str, np.ndarray] = {}

    def configure_train(self, server_round, arrays, config, grid):
        self.sent = {k: a.numpy().copy() for k, a in arrays.items()}
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        self.norms[server_round] = [
            float(np.sqrt(sum(((r.content["arrays"][k].numpy() - g) ** 2).sum() for k, g in self.sent.items())))
            for r in replies
        ]
        return super().aggregate_train(server_round, replies)


def fedavg_kw():
    return {"fraction_evaluate": 1.0, "min_available_nodes": N, "min_train_nodes": N, "min_evaluate_nodes": N}


def run(strategy, app, rounds=2):
    grid = InProcessGrid(app, N, {})
    return strategy.start(grid=grid, initial_arrays=initial(), num_rounds=rounds, train_config=ConfigRecord())


# -- (a) client-side clipping after (inside) our mod ---------------------------------------------

@pytest.mark.parametrize("compressor", ["none", "sign"])
def test_fixedclipping_mod_inside_compression_mod_bounds_the_decoded_updates(compressor):
    inner = RecordingFedAvg(**fedavg_kw())
    dp = DifferentialPrivacyClientSideFixedClipping(inner, noise_multiplier=0.0, clipping_norm=CLIP,
                                                    num_sampled_clients=N)
    s = CompressedStrategy(dp, compressor=compressor, error_feedback=False)
    res = run(s, client_app([compression_mod], [fixedclipping_mod]))
    for rnd in (1, 2):
        assert s.history[rnd]["num-replies"] == N and s.history[rnd]["failed-clients"] == 0
        norms = inner.norms[rnd]
        assert len(norms) == N and max(norms) <= CLIP + 1e-5
        if compressor == "none":  # exact: clipped to the norm (the raw update has norm ~ 3*sqrt(36))
            assert min(norms) == pytest.approx(CLIP, abs=1e-5)
    assert set(res.evaluate_metrics_clientapp) == {1, 2}  # evaluate messages pass both mods


def test_error_feedback_under_client_side_clipping_never_sends_over_the_clipping_norm():
    """Error feedback is refused with Flower's client-side clipping: the client would send
    C(clipped + residual), whose norm is not bounded by the clipping norm from round 2 on (the DP
    sensitivity assumption). With the constructor's check bypassed, the client still bounds what the
    server decodes (it rescales its update, or fails when the residual alone is too long)."""
    inner = RecordingFedAvg(**fedavg_kw())
    dp = DifferentialPrivacyClientSideFixedClipping(inner, noise_multiplier=0.0, clipping_norm=CLIP,
                                                    num_sampled_clients=N)
    with pytest.raises(ValueError, match="breaks the DP guarantee"):
        CompressedStrategy(dp, compressor="topk", density=0.25, error_feedback=True)
    s = CompressedStrategy(dp, compressor="topk", density=0.25, error_feedback=False)
    s.codec = dataclasses.replace(s.codec, error_feedback=True)  # what the check prevents
    run(s, client_app([compression_mod], [fixedclipping_mod]), rounds=3)
    sent = {r: inner.norms.get(r, []) for r in (1, 2, 3)}  # no entry: every client failed that round
    assert all(max(sent[r], default=0.0) <= CLIP * (1 + 1e-6) for r in (1, 2, 3))
    assert sum(len(sent[r]) + s.history[r]["failed-clients"] for r in (1, 2, 3)) == 3 * N


# -- (b) robust aggregators as the inner strategy ------------------------------------------------

@pytest.mark.parametrize("inner_cls", [FedMedian, FedTrimmedAvg])
def test_robust_aggregators_inside_compressed_strategy(inner_cls):
    # 3 clients; FedTrimmedAvg with beta 0.34 cuts int(0.34 * 3) = 1 from each end: the median too
    kw = fedavg_kw() | ({"beta": 0.34} if inner_cls is FedTrimmedAvg else {})
    s = CompressedStrategy(inner_cls(**kw), compressor="none")
    start = {k: a.numpy().copy() for k, a in initial().items()}
    res = run(s, client_app([compression_mod], []), rounds=1)
    # with the "none" codec the decoded replies are exactly the clients' weights
    sent = [big_step_train(_train_msg(), _ctx(pid)).content["arrays"] for pid in range(N)]
    for k in start:
        stacked = np.stack([rec[k].numpy() for rec in sent])
        np.testing.assert_allclose(res.arrays[k].numpy(), np.median(stacked, axis=0), atol=1e-5)
    assert s.history[1]["num-replies"] == N and s.history[1]["rejected-replies"] == 0


def test_robust_aggregator_trains_the_example_model():
    import importlib
    import pathlib
    import sys

    example = pathlib.Path(__file__).resolve().parents[2] / "examples" / "existing-app"
    sys.path.insert(0, str(example))
    try:
        capp = importlib.import_module("existingapp.client_app")
        task = importlib.import_module("existingapp.task")
        cfg = {"local-epochs": 1}
        s = CompressedStrategy(FedMedian(fraction_evaluate=0.0, min_available_nodes=N, min_train_nodes=N),
                               compressor="sign")
        start = ArrayRecord(task.Net().state_dict())
        init = {k: v.numpy().copy() for k, v in start.items()}
        res = s.start(grid=InProcessGrid(capp.app, N, cfg), initial_arrays=start, num_rounds=2,
                      train_config=ConfigRecord({"lr": 0.05}))
    finally:
        sys.path.remove(str(example))
        for name in [m for m in sys.modules if m == "existingapp" or m.startswith("existingapp.")]:
            del sys.modules[name]
    assert all(s.history[r]["num-replies"] == N and s.history[r]["upload-bytes-sign"] > 0 for r in (1, 2))
    assert any(not np.array_equal(res.arrays[k].numpy(), init[k]) for k in init)


# -- (c) wrong compositions: what happens today ----------------------------------------------------

@pytest.mark.parametrize("compressor", ["sign", "stc"])
def test_compression_mod_inside_fixedclipping_mod_fails_every_client(compressor, caplog):
    """Our mod AFTER Flower's clipping mod: our mod sees the unclipped update and refuses with a
    message that says how to fix the order. Every train reply becomes an error reply; the global
    model does not move."""
    reason = "Flower's clipping mod must run INSIDE compression_mod"
    dp = DifferentialPrivacyClientSideFixedClipping(FedAvg(**fedavg_kw()), noise_multiplier=0.0,
                                                    clipping_norm=CLIP, num_sampled_clients=N)
    s = CompressedStrategy(dp, compressor=compressor, error_feedback=False)
    with caplog.at_level(logging.WARNING):
        res = run(s, client_app([], [fixedclipping_mod, compression_mod]), rounds=1)
    assert s.history[1]["failed-clients"] == N and s.history[1]["num-replies"] == 0
    assert len(res.arrays) == 0  # Flower's Result holds no aggregate: the global model never moved
    assert reason in caplog.text


def test_dp_mod_registered_globally_fails_evaluate_messages(caplog):
    """fixedclipping_mod in ClientApp(mods=[...]) also sees evaluate messages, which carry no
    clipping norm: training works, every evaluation fails."""
    dp = DifferentialPrivacyClientSideFixedClipping(FedAvg(**fedavg_kw()), noise_multiplier=0.0,
                                                    clipping_norm=CLIP, num_sampled_clients=N)
    s = CompressedStrategy(dp, compressor="none", error_feedback=False)
    with caplog.at_level(logging.INFO):
        res = run(s, client_app([compression_mod, fixedclipping_mod], []), rounds=1)
    assert s.history[1]["num-replies"] == N
    assert res.evaluate_metrics_clientapp == {}


def test_plain_fedavg_receiving_payloads_raises_in_the_serverapp():
    """A server strategy not wrapped in CompressedStrategy: Flower's FedAvg calls Array.numpy() on
    the payloads and the ServerApp dies with a TypeError naming our stype (no hint how to fix).
    The client compressed with the default codec although the server never asked for one."""
    s = FedAvg(fraction_evaluate=0.0, min_available_nodes=N, min_train_nodes=N)
    with pytest.raises(TypeError, match="Unsupported serialization type for numpy conversion: 'fedcomp.payload.v1'"):
        run(s, client_app([compression_mod], []), rounds=1)
