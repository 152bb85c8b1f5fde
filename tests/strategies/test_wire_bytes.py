"""What a round costs on the wire, counted as Flower serialises each message, both ways, evaluation
included; checked against an independent counter (a Grid that weighs every message it carries), and
the compressed download carrying the evaluate messages too."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.serde import recorddict_to_proto
from flwr.serverapp.strategy import FedAvg

from fedcomp.client import compression_mod
from fedcomp.run.inprocess_grid import InProcessGrid
from fedcomp.strategies import CompressedStrategy, Download

torch.manual_seed(0)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 32)
        self.bn = torch.nn.BatchNorm1d(32)
        self.fc2 = torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _data(pid: int):
    g = torch.Generator().manual_seed(pid)
    x = torch.randn(64, 64, generator=g)
    return x, (x[:, :10].argmax(1))


def _client_app() -> ClientApp:
    app = ClientApp(mods=[compression_mod])

    app.train()(_train_step)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        model = Net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        model.eval()
        x, y = _data(context.node_config["partition-id"])
        with torch.no_grad():
            acc = float((model(x).argmax(1) == y).float().mean())
        return Message(RecordDict({"metrics": MetricRecord({"eval-acc": acc, "num-examples": 64})}), reply_to=msg)

    return app


class WeighingGrid(InProcessGrid):
    """The independent counter: every message the ServerApp sends and every reply, serialised."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.down = self.up = 0
        self.evaluate_down = 0

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        for m in messages:
            size = recorddict_to_proto(m.content).ByteSize()
            self.down += size
            if m.metadata.message_type.startswith("evaluate"):
                self.evaluate_down += size
        replies = list(super().send_and_receive(messages, timeout=timeout))
        self.up += sum(recorddict_to_proto(r.content).ByteSize() for r in replies if not r.has_error())
        return replies


def _run(rounds=3, nodes=4, fault=None, **kwargs):
    strategy = CompressedStrategy(FedAvg(fraction_train=1.0, fraction_evaluate=0.5, min_available_nodes=2,
                                         min_train_nodes=2, min_evaluate_nodes=1), **kwargs)
    grid = WeighingGrid(_client_app(), nodes, {}, fault=fault)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()), num_rounds=rounds,
                            train_config=ConfigRecord({}))
    return strategy, grid, result


@pytest.mark.parametrize("downstream", [None, "stc"])
def test_the_strategy_counts_what_an_independent_counter_counts(downstream):
    strategy, grid, _ = _run(compressor="stc", density=0.05, downstream=downstream)
    down = sum(strategy.history[r]["wire-bytes-down"] for r in (1, 2, 3))
    up = sum(strategy.history[r]["wire-bytes-up"] for r in (1, 2, 3))
    assert down == grid.down and up == grid.up  # exact: the same serialisation, counted in two places
    ev = sum(strategy.history[r]["wire-bytes-evaluate-down"] for r in (1, 2, 3))
    assert ev == grid.evaluate_down > 0
    for r in (1, 2, 3):
        h = strategy.history[r]
        assert h["wire-bytes-up"] > h["upload-bytes"]  # records around the payloads
        assert h["wire-ratio"] == pytest.approx(h["wire-bytes-fp32"] / (h["wire-bytes-down"] + h["wire-bytes-up"]))


def test_failed_clients_downloads_are_counted():
    strategy, grid, _ = _run(fault=lambda rnd, pid: "boom" if pid == 0 else None, compressor="sign")
    assert sum(strategy.history[r]["wire-bytes-down"] for r in (1, 2, 3)) == grid.down
    assert strategy.history[1]["failed-clients"] == 1


def test_evaluation_rides_the_compressed_download():
    """Dense evaluation would send 2 nodes the whole model every round; with the download compressed each
    evaluating node gets a step or a catch-up, and the evaluation still runs on every sampled node."""
    dense_model = recorddict_to_proto(RecordDict({"arrays": ArrayRecord(Net().state_dict())})).ByteSize()
    strategy, grid, result = _run(compressor="stc", density=0.05, downstream=Download("stc", density=0.05))
    for r in (2, 3):  # round 1's evaluators may be new to the download (a first contact)
        assert strategy.history[r]["wire-bytes-evaluate-down"] < 2 * dense_model / 4
    assert set(result.evaluate_metrics_clientapp) == {1, 2, 3}
    assert all(strategy.evaluate_history[r]["num-replies"] == 2 for r in (1, 2, 3))
    plain, plain_grid, _ = _run(compressor="stc", density=0.05, downstream="none")
    assert plain.history[2]["wire-bytes-evaluate-down"] >= 2 * dense_model


def test_an_evaluating_node_trains_next_round_from_the_copy_it_evaluated():
    """The node's copy moves on with the evaluate message; the next train message builds on it, and every
    node's copy equals the server's record of it."""
    # "auto": the server records each node's BatchNorm statistics (under "small", the library's default, they
    # are sent exactly in every message and its record of them is the latest global's)
    strategy, grid, _ = _run(rounds=3, compressor="stc", density=0.05, downstream="stc", batchnorm_stats="auto")
    from fedcomp.protocol.messages import MODEL_STATE_KEY
    from fedcomp.statedict import FlatModel

    compared = 0
    for nid, ctx in grid.contexts.items():
        held = strategy.downstream.held(nid)
        if held is None or MODEL_STATE_KEY not in ctx.state:
            continue
        copy = FlatModel.from_record(ctx.state[MODEL_STATE_KEY]).flat
        np.testing.assert_array_equal(copy, held)
        compared += 1
    assert compared == 4


@pytest.mark.parametrize("downstream", ["stc", "sign", "int8"])
def test_a_node_that_evaluated_the_global_model_trains_from_that_copy_and_downloads_no_new_step(downstream):
    """The broadcast moves once per global model: evaluation after round r sends each evaluating node the
    step to it, and round r + 1's train message (the global model unchanged) sends that node no step (the
    config and the exact tensors only): the node trains exactly the model it evaluated."""
    import hashlib

    evaluated: dict[int, tuple[int, str]] = {}
    trained_from: list[tuple[int, int, str, str]] = []
    app = ClientApp(mods=[compression_mod])

    def digest(msg: Message) -> str:
        sd = msg.content["arrays"].to_torch_state_dict()
        return hashlib.sha256(b"".join(t.numpy().tobytes() for t in sd.values())).hexdigest()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        if context.node_id in evaluated:
            trained_from.append((str(strategy.downstream.sent_kind[context.node_id]), context.node_id, digest(msg),
                                 evaluated[context.node_id][1]))
        return _train_step(msg, context)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        evaluated[context.node_id] = (msg.content["config"]["server-round"], digest(msg))
        return Message(RecordDict({"metrics": MetricRecord({"eval-acc": 0.5, "num-examples": 1})}), reply_to=msg)

    strategy = CompressedStrategy(FedAvg(fraction_train=1.0, fraction_evaluate=1.0, min_available_nodes=3),
                                  compressor="stc", density=0.1, downstream=downstream)
    grid = WeighingGrid(app, 3, {})
    strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()), num_rounds=3,
                   train_config=ConfigRecord({}))
    assert len(trained_from) == 6 and all(got == want for _, _, got, want in trained_from)
    assert {kind for kind, *_ in trained_from} == {"held"}  # no step: the config and the exact tensors
    for r in (2, 3):
        h = strategy.history[r]
        assert h["wire-bytes-train-down"] < h["wire-bytes-evaluate-down"]
    assert not any(strategy.failure_history[r] or strategy.evaluate_failure_history[r] for r in (1, 2, 3))


@pytest.mark.parametrize("init", ["dense", "auto"])
def test_a_node_whose_evaluate_reply_was_lost_trains_next_round(init):
    """A node's copy moves to the new version with the evaluate message; its reply is lost, so the server
    forgets the node and sends it the same version whole (dense, or a first contact) with the next train
    message: the node takes it and trains (it refused it as a replay when versions moved per message)."""
    class LossyGrid(WeighingGrid):  # node 1001's round-1 evaluate reply is lost on the way back
        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            replies = list(super().send_and_receive(messages, timeout=timeout))
            return [Message(Error(code=2, reason="lost"), reply_to=m)
                    if m.metadata.message_type.startswith("evaluate") and m.metadata.dst_node_id == 1001
                    and m.content["config"]["server-round"] == 1 else r for m, r in zip(messages, replies)]

    strategy = CompressedStrategy(FedAvg(fraction_train=1.0, fraction_evaluate=1.0, min_available_nodes=2),
                                  compressor="sign", downstream=Download("sign", init=init))
    strategy.start(grid=LossyGrid(_client_app(), 2, {}), initial_arrays=ArrayRecord(Net().state_dict()),
                   num_rounds=3, train_config=ConfigRecord({}))
    assert all(not strategy.failure_history[r] for r in (1, 2, 3))
    assert all(strategy.history[r]["num-replies"] == 2 for r in (1, 2, 3))


def _train_step(msg: Message, context: Context) -> Message:
    """Three SGD steps on the node's data from the received model; the full weights back."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = _data(context.node_config["partition-id"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                               "metrics": MetricRecord({"num-examples": 64})}), reply_to=msg)


@pytest.mark.parametrize("downstream", ["stc", "sign", "int8"])
def test_partial_participation_evaluates_on_new_lagging_and_current_copies(downstream):
    """Half of the nodes train and another random half evaluate each round: an evaluating node may hold
    nothing (a first contact), an old copy (a catch-up) or the latest one; every evaluation succeeds and
    every copy a node holds is the one the server records."""
    import random

    from fedcomp.download.layout import gather
    from fedcomp.protocol.messages import MODEL_STATE_KEY
    from fedcomp.statedict import FlatModel

    random.seed(3)
    strategy = CompressedStrategy(FedAvg(fraction_train=0.5, fraction_evaluate=0.5, min_available_nodes=6,
                                         min_train_nodes=3, min_evaluate_nodes=3), compressor="stc", density=0.1,
                                  downstream=downstream)
    grid = WeighingGrid(_client_app(), 6, {})
    strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()), num_rounds=4,
                   train_config=ConfigRecord({}))
    assert all(strategy.evaluate_history[r]["num-replies"] == 3 for r in (1, 2, 3, 4))
    assert all(not strategy.evaluate_failure_history[r] and not strategy.failure_history[r] for r in (1, 2, 3, 4))
    compared = 0
    for nid, ctx in grid.contexts.items():
        held = strategy.downstream.nodes.held(nid)  # the compressed part the server records for the node
        if held is not None and MODEL_STATE_KEY in ctx.state:
            copy = FlatModel.from_record(ctx.state[MODEL_STATE_KEY])
            np.testing.assert_array_equal(gather(copy, strategy.downstream.lossy_keys), held)
            compared += 1
    assert compared >= 3
