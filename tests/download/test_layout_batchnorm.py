"""Downstream compression must not corrupt BatchNorm. With ``batchnorm-stats = "small"`` the running
statistics travel exactly downstream (and with ``small-tensor-compressor`` upstream), so every
client's copy of them is the global model's, and the global running variance stays positive
(``"auto"``, the default: ``test_stat_deltas.py``)."""

import logging

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg
from torch import nn

from fedcomp.client import compression_mod
from fedcomp.protocol.messages import MODEL_STATE_KEY
from fedcomp.run.inprocess_grid import InProcessGrid
from fedcomp.strategies import CompressedStrategy

logging.getLogger("flwr").setLevel(logging.WARNING)

STATS = ("1.running_mean", "1.running_var", "1.num_batches_tracked")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


bn_app = ClientApp(mods=[compression_mod])


@bn_app.train()
def _train(msg: Message, context: Context) -> Message:
    """Five SGD steps on this node's own data (a per-node scale, so the batch variances differ)."""
    model = _model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    pid = int(context.node_config["partition-id"])
    g = torch.Generator().manual_seed(100 * pid + int(msg.content["config"]["server-round"]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        x = torch.randn(32, 6, generator=g) * (0.2 + pid)
        y = (x[:, 0] > 0).long()
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                          "metrics": MetricRecord({"num-examples": 32, "train-loss": float(loss.detach())})})
    return Message(content=content, reply_to=msg)


def _run(downstream: str, rounds: int = 4, batchnorm_stats: str = "small", after_send=None, keep_bytes=False):
    """``rounds`` rounds of 3 clients; per round (sent statistics, what each node holds), or with
    ``keep_bytes`` the bytes sent to each node; ``after_send(strategy, grid, msgs, round)`` runs once
    the nodes have rebuilt their copies."""
    grid = InProcessGrid(bn_app, 3, {})
    s = CompressedStrategy(FedAvg(min_available_nodes=3, fraction_evaluate=0.0), compressor="sign",
                           downstream=downstream, batchnorm_stats=batchnorm_stats)
    arrays = ArrayRecord(_model().state_dict())
    sent_stats = []
    for rnd in range(1, rounds + 1):
        sent = {k: arrays[k].numpy().copy() for k in STATS}
        msgs = list(s.configure_train(rnd, arrays, ConfigRecord({"seed": 1}), grid))
        replies = grid.send_and_receive(msgs)
        held = [grid.contexts[m.metadata.dst_node_id].state[MODEL_STATE_KEY] for m in msgs]
        if after_send is not None:
            after_send(s, grid, msgs, rnd)
        sent_stats.append(dict(s.downstream.sent_bytes) if keep_bytes else (sent, held))
        arrays, _ = s.aggregate_train(rnd, replies)
        assert arrays["1.running_var"].numpy().min() > 0, f"round {rnd}: running_var went negative"
    return arrays, sent_stats


@pytest.mark.parametrize("codec", ["stc", "sign"])
def test_running_statistics_stay_exact_downstream(codec):
    arrays, sent_stats = _run(codec)
    assert len(sent_stats) == 4
    for sent, held in sent_stats:
        assert len(held) == 3
        for h in held:  # every client trains from the global statistics, bit for bit
            for k in STATS:
                assert h[k].numpy().dtype == sent[k].dtype
                assert np.array_equal(h[k].numpy(), sent[k])
    assert arrays["1.running_var"].numpy().min() > 0
    assert int(arrays["1.num_batches_tracked"].numpy()) == 4 * 5  # 5 steps a round, integer rule


def test_statistics_compressed_only_when_asked():
    """``batchnorm-stats = "codec"`` compresses them downstream too (the user's explicit choice)."""
    from fedcomp.config import CodecConfig
    from fedcomp.download.sender import Downstream

    d = Downstream(CodecConfig.from_mapping({"batchnorm-stats": "codec"}), "stc")
    from fedcomp.statedict import FlatModel

    sd = {k: v.numpy() for k, v in _model().state_dict().items()}
    d._setup(FlatModel(sd, {k: str(v.dtype) for k, v in sd.items()}))
    assert "1.running_var" in d.lossy_keys and d.exempt_keys == []
    d2 = Downstream(CodecConfig(batchnorm_stats="small"), "stc")
    d2._setup(FlatModel(sd, {k: str(v.dtype) for k, v in sd.items()}))
    assert d2.exempt_keys == ["1.running_mean", "1.running_var"] and "1.running_var" not in d2.lossy_keys
