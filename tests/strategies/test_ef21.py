"""EF21 (`error-feedback = "ef21"`, Richtárik et al. 2021): client estimate h_i, server estimate h."""

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import FedAvg, FedMedian

import fedcomp.compression as fc
from fedcomp.config import CodecConfig
from fedcomp.protocol.messages import MODEL_KEY, RESIDUAL_STATE_KEY
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
    from fedcomp.app.client_app import app as client_app
    from fedcomp.task.models import build_model
    from fedcomp.run.inprocess_grid import InProcessGrid

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
    from fedcomp.app.config import AppConfig
    with pytest.raises(ValueError, match="ef21.*fraction-train.*client-sampling"):
        AppConfig.from_run_config({"error-feedback": "ef21", **extra})
    AppConfig.from_run_config({"error-feedback": "ef21"})  # full participation: accepted


def test_ef21_strategy_refuses_fraction_train_below_one():
    with pytest.raises(ValueError, match="fraction_train"):
        CompressedStrategy(FedAvg(fraction_train=0.5), compressor="topk", density=0.1, error_feedback="ef21")


def test_ef21_missing_client_is_counted_in_the_round_metrics():
    from fedcomp.app.client_app import app as client_app
    from fedcomp.task.models import build_model
    from fedcomp.run.inprocess_grid import InProcessGrid
    grid = InProcessGrid(client_app, 3, {"lr": 0.05})
    s = CompressedStrategy(FedAvg(min_available_nodes=3, fraction_evaluate=0.0), compressor="topk", density=0.1,
                           error_feedback="ef21")
    arrays = ArrayRecord(build_model().state_dict())
    msgs = list(s.configure_train(1, arrays, ConfigRecord({"seed": 1}), grid))
    replies = grid.send_and_receive(msgs[:2])  # the third sampled node never replies
    _, _ = s.aggregate_train(1, replies)
    metrics = s.history[1]  # the round's own figures (Flower gets the headline ones)
    assert metrics["ef21-missing-clients"] == 1.0
    replies = grid.send_and_receive(list(s.configure_train(2, arrays, ConfigRecord({"seed": 1}), grid)))
    _, _ = s.aggregate_train(2, replies)
    metrics = s.history[2]  # the round's own figures (Flower gets the headline ones)
    assert metrics["ef21-missing-clients"] == 0.0


def _ef21_round(s, grid, rnd, arrays):
    msgs = list(s.configure_train(rnd, arrays, ConfigRecord({"seed": 1}), grid))
    arrays, _ = s.aggregate_train(rnd, grid.send_and_receive(msgs))
    return arrays, s.history[rnd]  # the round's own figures (Flower gets the headline ones)


def test_a_client_that_lost_its_estimate_is_refused_by_name_not_folded(caplog):
    """A SuperNode restarted without client-state-dir (its context.state emptied) while the server's h keeps
    its share: its replies are refused as a named failure (was: folded, h silently diverged), in every
    later round too (its h_i restarted from zero can never match again); the other node is folded."""
    import logging

    from fedcomp.app.client_app import app as client_app
    from fedcomp.task.models import build_model
    from fedcomp.run.inprocess_grid import InProcessGrid
    from flwr.app import RecordDict

    grid = InProcessGrid(client_app, 2, {"lr": 0.05})
    s = CompressedStrategy(FedAvg(min_available_nodes=2, fraction_evaluate=0.0), compressor="topk", density=0.1,
                           error_feedback="ef21", downstream="none")  # the estimate's check
    arrays = ArrayRecord(build_model().state_dict())
    _, m = _ef21_round(s, grid, 1, arrays)
    assert m["failed-clients"] == 0 and s.ef21.folded == {1000: 1, 1001: 1}
    grid.contexts[1000].state = RecordDict()  # the restarted SuperNode: no h_i
    with caplog.at_level(logging.WARNING, logger="flwr"):
        _, m = _ef21_round(s, grid, 2, arrays)
    why = ("the client holds no estimate (a fresh h_i), but the server's estimate h holds its sends up to round 1 (a "
           "SuperNode restarted without client-state-dir, or a reply the server never received): its update would "
           "corrupt h; the node stays refused until the run is restarted or resumed with its state")
    assert s.failure_history[2] == [{"node": 1000, "code": -2, "error": "EF21_STATE_MISMATCH", "reason": why}]
    assert f"round 2: EF21: reply of node 1000 refused: {why}" in [r.getMessage() for r in caplog.records]
    assert m["failed-clients"] == 1 and m["num-replies"] == 1 and m["ef21-missing-clients"] == 1
    assert s.ef21.folded == {1000: 1, 1001: 2}
    _, m = _ef21_round(s, grid, 3, arrays)  # its h_i now holds round 2's send, which h never got
    assert [f["node"] for f in s.failure_history[3]] == [1000] and "as of round 2" in s.failure_history[3][0]["reason"]
    assert s.ef21.folded == {1000: 1, 1001: 3}


def test_a_client_whose_first_reply_was_lost_is_refused_from_round_two_on(caplog):
    """Node 1000's round-1 reply never reached the server, but its h_i holds that send: it was accepted
    from round 2 on (a node never folded was taken whatever it reported) and h drifted silently."""
    import logging

    from fedcomp.app.client_app import app as client_app
    from fedcomp.run.inprocess_grid import InProcessGrid
    from fedcomp.task.models import build_model

    grid = InProcessGrid(client_app, 2, {"lr": 0.05})
    s = CompressedStrategy(FedAvg(min_available_nodes=2, fraction_evaluate=0.0), compressor="topk", density=0.1,
                           error_feedback="ef21")
    arrays = ArrayRecord(build_model().state_dict())
    msgs = list(s.configure_train(1, arrays, ConfigRecord({"seed": 1}), grid))
    replies = list(grid.send_and_receive(msgs))
    s.aggregate_train(1, [r for r in replies if r.metadata.src_node_id != 1000])  # the lost reply
    assert s.ef21.folded == {1001: 1}
    with caplog.at_level(logging.WARNING, logger="flwr"):
        _, m = _ef21_round(s, grid, 2, arrays)
    why = ("the client holds its estimate h_i as of round 1, but the server's estimate h holds no send of this node "
           "(its first reply never arrived, or it comes back under a new node id): its update would corrupt h; the "
           "node stays refused until the run is restarted or resumed with its state")
    assert s.failure_history[2] == [{"node": 1000, "code": -2, "error": "EF21_STATE_MISMATCH", "reason": why}]
    assert m["failed-clients"] == 1 and m["num-replies"] == 1
    assert s.ef21.folded == {1001: 2}


def test_the_estimate_round_is_required_and_the_record_survives_a_checkpoint():
    from fedcomp.strategies.ef21_aggregate import EF21Aggregate
    from tests.messages import reply_with, train_msg, weights

    agg = EF21Aggregate()
    g = weights(0)
    silent, said = reply_with(train_msg(g, dst=5), g), reply_with(train_msg(g, dst=6), g, extra_metrics={
        "ef21-estimate-round": 0.0})
    kept, refused = agg.check_replies(1, [silent, said])
    assert kept == [said] and [f["node"] for _, f in refused] == [5]
    assert refused[0][1]["reason"].startswith("the reply does not say which round its EF21 estimate h_i is from")
    agg.folded = {5: 3, 2**64 - 1: 7}
    agg.h = {"w": np.zeros(200), "b": np.zeros(10)}
    back = EF21Aggregate()
    back.load_state_dict(agg.state_dict(), {"w": (20, 10), "b": (10,)}, agg.folded_state())
    assert back.folded == {5: 3, 2**64 - 1: 7} and sorted(back.h) == ["b", "w"]
    bad = {**agg.folded_state(), "rounds": np.array([-1, 2], dtype=np.int64)}
    with pytest.raises(ValueError, match="EF21's record of folded sends"):
        back.load_state_dict(agg.state_dict(), {"w": (20, 10), "b": (10,)}, bad)
    assert back.folded == {5: 3, 2**64 - 1: 7}  # unchanged
    old = EF21Aggregate()
    old.load_state_dict({"w": np.zeros(200)}, {"w": (20, 10)})  # a checkpoint from before the record
    assert old.folded == {} and not old.complete  # it cannot tell a lost first reply from an old node
    late = reply_with(train_msg(g, dst=9), g, extra_metrics={"ef21-estimate-round": 4.0})
    assert old.check_replies(5, [late]) == ([late], [])
    assert agg.complete and [f["node"] for _, f in agg.check_replies(5, [late])[1]] == [9]
