"""Fixes for the hostile-review findings F4-F7 (EF21 participation, per-node EF override, dense replies under
downstream, downstream server memory)."""
import logging

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

logging.getLogger("flwr").setLevel(logging.ERROR)


# ---- F5: EF21 needs full participation -----------------------------------------------------
@pytest.mark.parametrize("extra", [{"fraction-train": 0.3}, {"client-sampling": "poisson"}])
def test_ef21_with_client_sampling_is_refused(extra):
    from fedcomp.config import AppConfig
    with pytest.raises(ValueError, match="ef21.*fraction-train.*client-sampling"):
        AppConfig.from_run_config({"error-feedback": "ef21", **extra})
    AppConfig.from_run_config({"error-feedback": "ef21"})  # full participation: accepted


def test_ef21_strategy_refuses_fraction_train_below_one():
    from flwr.serverapp.strategy import FedAvg
    from fedcomp.strategies import CompressedStrategy
    with pytest.raises(ValueError, match="fraction_train"):
        CompressedStrategy(FedAvg(fraction_train=0.5), compressor="topk", density=0.1, error_feedback="ef21")


def test_ef21_missing_client_is_counted_in_the_round_metrics():
    from flwr.serverapp.strategy import FedAvg
    from fedcomp.client.app import app as client_app
    from fedcomp.models import build_model
    from fedcomp.simulation import InProcessGrid
    from fedcomp.strategies import CompressedStrategy
    grid = InProcessGrid(client_app, 3, {"lr": 0.05})
    s = CompressedStrategy(FedAvg(min_available_nodes=3, fraction_evaluate=0.0), compressor="topk", density=0.1,
                           error_feedback="ef21")
    arrays = ArrayRecord(build_model().state_dict())
    msgs = list(s.configure_train(1, arrays, ConfigRecord({"seed": 1}), grid))
    replies = grid.send_and_receive(msgs[:2])  # the third sampled node never replies
    _, metrics = s.aggregate_train(1, replies)
    assert metrics["ef21-missing-clients"] == 1.0
    replies = grid.send_and_receive(list(s.configure_train(2, arrays, ConfigRecord({"seed": 1}), grid)))
    _, metrics = s.aggregate_train(2, replies)
    assert metrics["ef21-missing-clients"] == 0.0


# ---- F6: node config cannot switch error-feedback against EF21 -------------------------------
@pytest.mark.parametrize("server_ef,node_ef", [("ef21", True), ("ef21", False), (True, "ef21")])
def test_node_config_cannot_switch_error_feedback_against_ef21(server_ef, node_ef):
    from flwr.serverapp.strategy import FedAvg
    from fedcomp.client.app import app as client_app
    from fedcomp.models import build_model
    from fedcomp.simulation import InProcessGrid
    from fedcomp.strategies import CompressedStrategy
    grid = InProcessGrid(client_app, 2, {"lr": 0.05}, node_configs=[{"error-feedback": node_ef}] * 2)
    s = CompressedStrategy(FedAvg(min_available_nodes=2, fraction_evaluate=0.0), compressor="topk", density=0.1,
                           error_feedback=server_ef)
    msgs = list(s.configure_train(1, ArrayRecord(build_model().state_dict()), ConfigRecord({"seed": 1}), grid))
    replies = grid.send_and_receive(msgs)
    assert all(r.has_error() for r in replies)
    assert "error-feedback" in replies[0].error.reason


def test_node_config_may_still_switch_classic_error_feedback():
    from fedcomp.client.request import _codec
    from flwr.app import Context
    ctx = Context(run_id=1, node_id=1, node_config={"error-feedback": False}, state=RecordDict(), run_config={})
    assert _codec({"compressor": "topk", "error-feedback": True}, ctx).error_feedback is False


# ---- F7: dense replies under downstream -------------------------------------------------------
def test_dense_reply_under_downstream_is_rejected():
    from flwr.serverapp.strategy import FedAvg
    from fedcomp.client.app import app as client_app
    from fedcomp.models import build_model
    from fedcomp.simulation import InProcessGrid
    from fedcomp.statedict import FlatModel
    from fedcomp.strategies import CompressedStrategy
    grid = InProcessGrid(client_app, 3, {"lr": 0.1})
    s = CompressedStrategy(FedAvg(min_available_nodes=3, fraction_evaluate=0.0), compressor="stc", density=0.05,
                           downstream="stc")
    arrays = ArrayRecord(build_model().state_dict())
    for rnd in range(1, 4):
        arrays, _ = s.aggregate_train(rnd, grid.send_and_receive(list(s.configure_train(rnd, arrays, ConfigRecord({"seed": 1}), grid))))
    x = sorted(grid.contexts)[0]
    s.downstream.node_version.pop(x)
    msgs = list(s.configure_train(4, arrays, ConfigRecord({"seed": 1}), grid))
    mx = next(m for m in msgs if m.metadata.dst_node_id == x)
    others = [m for m in msgs if m is not mx]
    same = Message(RecordDict({"arrays": ArrayRecord(dict(mx.content["arrays"].items())),
                               "metrics": MetricRecord({"num-examples": 10**6})}), reply_to=mx)
    new, metrics = s.aggregate_train(4, grid.send_and_receive(others) + [same])
    assert metrics["rejected-replies"] == 1.0
    # x's dense reply did not move the model towards what it was sent; the two others are the round's mean
    assert np.isfinite(FlatModel.from_record(new).flat).all()


# ---- F4: downstream server memory -------------------------------------------------------------
def test_downstream_server_memory_is_bounded_with_many_clients():
    from fedcomp.config import CodecConfig
    from fedcomp.statedict import to_record
    from fedcomp.strategies.downstream import Downstream
    from tests.messages import make_msg
    D, ds, rng = 50_000, Downstream(CodecConfig.from_mapping({"density": 0.01}), "stc"), np.random.default_rng(0)
    w = rng.standard_normal(D).astype(np.float32)
    for r in range(1, 61):
        w = (w + 0.01 * rng.standard_normal(D)).astype(np.float32)
        rec = to_record({"w": torch.from_numpy(w)})
        nodes = sorted(rng.choice(300, 10, replace=False).tolist())
        msgs = [make_msg(RecordDict({"arrays": rec, "config": ConfigRecord({"server-round": r})}), dst=n)
                for n in nodes]
        ds.prepare(r, rec, msgs)
        for n in nodes:
            ds.received(n)
        assert ds._copies() <= ds.max_copies == 8
    copies = (sum(v.nbytes for v in ds._versions.values()) + sum(v.nbytes for v in ds._private.values())) / (4 * D)
    assert copies <= 8  # before the fix: ~250 model copies after 100 rounds
