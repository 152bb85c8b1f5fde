"""EF21 (`error-feedback = "ef21"`, Richtárik et al. 2021): client estimate h_i, server estimate h."""

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import FedAvg, FedMedian

import fedcomp.compression as fc
from fedcomp.config import CodecConfig
from fedcomp.protocol import MODEL_KEY, RESIDUAL_STATE_KEY
from fedcomp.strategies import CompressedStrategy


@pytest.mark.parametrize("codec", [("sign", {}), ("topk", {"density": 0.05}), ("stc", {"density": 0.05})])
def test_client_estimate_is_the_sum_of_what_was_sent(codec):
    name, params = codec
    ef = fc.EF21(fc.get_compressor(name, **params))
    g = torch.Generator().manual_seed(0)
    sent = torch.zeros(300, dtype=torch.float64)
    target = torch.randn(300, generator=g)
    gaps = []
    for _ in range(30):  # the same update every round: h must converge to it
        sent += fc.decompress(ef.compress(target + 0.0)).double()
        gaps.append(float(torch.linalg.vector_norm(ef.residual - target)))
        assert torch.allclose(ef.residual.double(), sent, atol=1e-5)
    assert float(torch.linalg.vector_norm(ef.residual - target) / torch.linalg.vector_norm(target)) < 0.1
    assert gaps[-1] < 0.5 * gaps[0]  # the correction x - h shrinks
    state = ef.get_state()
    assert set(state) == {"residual"} and np.allclose(state["residual"], sent.numpy(), atol=1e-5)


def test_config_accepts_ef21_and_refuses_what_does_not_fit():
    assert CodecConfig.from_mapping({"error-feedback": "ef21"}).error_feedback == "ef21"
    assert "+EF21" in CodecConfig.from_mapping({"error-feedback": "ef21"}).describe()
    with pytest.raises(ValueError, match="'error-feedback' must be true, false or \"ef21\", got 'ef'"):
        CodecConfig.from_mapping({"error-feedback": "ef"})
    with pytest.raises(ValueError, match="'momentum-correction' must be 0 with error-feedback = 'ef21'"):
        CodecConfig.from_mapping({"error-feedback": "ef21", "momentum-correction": 0.5})
    with pytest.raises(ValueError, match="needs a weighted-mean inner strategy"):
        CompressedStrategy(FedMedian(), error_feedback="ef21")


def test_server_estimate_is_the_weighted_mean_of_the_clients_and_is_applied():
    """Real ClientApp + mod + CompressedStrategy(FedAvg) on the default CNN, 3 clients, 3 rounds."""
    from fedcomp.client.app import app as client_app
    from fedcomp.models import build_model
    from fedcomp.simulation import InProcessGrid

    weights: dict[int, float] = {}

    def app(msg, ctx):
        reply = client_app(msg, ctx)
        weights[ctx.node_id] = float(next(iter(reply.content.metric_records.values()))["num-examples"])
        return reply

    grid = InProcessGrid(app, 3, {"num-server-rounds": 3})
    s = CompressedStrategy(FedAvg(fraction_evaluate=0.0, min_available_nodes=3, min_train_nodes=3),
                           compressor="stc", density=0.02, error_feedback="ef21")
    seen: dict[int, dict[str, np.ndarray]] = {}

    def evaluate_fn(rnd, arrays):
        seen[rnd] = {k: a.numpy().copy() for k, a in arrays.items()}

    s.start(grid=grid, initial_arrays=ArrayRecord(build_model().state_dict()), num_rounds=3,
            train_config=ConfigRecord({"seed": 1}), evaluate_fn=evaluate_fn)
    keys = list(seen[0])
    h = np.concatenate([s.ef21.h[k] for k in keys])
    total = sum(weights.values())
    mean_hi = sum(w * grid.contexts[nid].state[RESIDUAL_STATE_KEY][MODEL_KEY].numpy().astype(np.float64)
                  for nid, w in weights.items()) / total
    np.testing.assert_allclose(h, mean_hi, atol=1e-6)
    applied = np.concatenate([(seen[3][k].astype(np.float64) - seen[2][k]).reshape(-1) for k in keys])
    np.testing.assert_allclose(applied, h, atol=1e-5)  # the server applies its estimate
    assert np.count_nonzero(applied) > 0.04 * applied.size  # h holds every send so far, not one round's 2 %


@pytest.mark.parametrize("extra", [{"fraction-train": 0.3}, {"client-sampling": "poisson"}])
def test_ef21_with_client_sampling_is_refused(extra):
    from fedcomp.config import AppConfig
    with pytest.raises(ValueError, match="ef21.*fraction-train.*client-sampling"):
        AppConfig.from_run_config({"error-feedback": "ef21", **extra})
    AppConfig.from_run_config({"error-feedback": "ef21"})  # full participation: accepted


def test_ef21_strategy_refuses_fraction_train_below_one():
    with pytest.raises(ValueError, match="fraction_train"):
        CompressedStrategy(FedAvg(fraction_train=0.5), compressor="topk", density=0.1, error_feedback="ef21")


def test_ef21_missing_client_is_counted_in_the_round_metrics():
    from fedcomp.client.app import app as client_app
    from fedcomp.models import build_model
    from fedcomp.simulation import InProcessGrid
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
