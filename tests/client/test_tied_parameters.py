"""A third-party app with tied input/output embeddings (GPT-2 style, ``lm_head.weight is wte.weight``)
that sends the tensor under both names: compression_mod refuses, naming both keys, instead of letting
the two copies be compressed and aggregated apart."""

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from torch import nn

from fedcomp.client import CompositionError, compression_mod
from fedcomp.statedict import retie, tied_aliases, untie
from tests.messages import make_ctx, train_msg


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(40, 8)
        self.ln = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 40, bias=False)
        self.lm_head.weight = self.wte.weight


def _train(model: TiedLM) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.arange(10)
    loss = nn.functional.cross_entropy(model.lm_head(model.ln(model.wte(x))), (x + 1) % 40)
    loss.backward()
    opt.step()


def _handler(model: TiedLM, send_tied_once: bool):
    def handle(msg: Message, ctx) -> Message:
        received = msg.content["arrays"].to_torch_state_dict()
        model.load_state_dict(retie(received, tied_aliases(model.state_dict())))
        _train(model)
        sd = untie(model.state_dict()) if send_tied_once else model.state_dict()
        metrics = MetricRecord({"num-examples": 10, "train-loss": 0.5})
        return Message(content=RecordDict({"arrays": ArrayRecord(sd), "metrics": metrics}), reply_to=msg)
    return handle


@pytest.mark.parametrize("compressor", ["randomk", "stc", "none"])
def test_tied_parameters_sent_under_both_names_are_refused_naming_both(compressor):
    torch.manual_seed(0)
    model = TiedLM()
    g = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    msg = train_msg(g, {"compressor": compressor, "density": 0.1, "seed": 1})
    with pytest.raises(CompositionError, match=r"'lm_head.weight' and 'wte.weight' hold one tensor"):
        compression_mod(msg, make_ctx(), _handler(model, send_tied_once=False))


def test_tied_parameters_sent_once_compress_as_one_tensor():
    torch.manual_seed(0)
    model = TiedLM()
    g = {k: v.detach().numpy().copy() for k, v in untie(model.state_dict()).items()}
    assert list(g) == ["wte.weight", "ln.weight", "ln.bias"]
    msg = train_msg(g, {"compressor": "randomk", "density": 0.1, "seed": 1})
    reply = compression_mod(msg, make_ctx(), _handler(model, send_tied_once=True))
    assert not reply.has_error() and "lm_head.weight" not in reply.content["arrays"]


def test_equal_untouched_tensors_are_not_taken_for_tied_ones():
    """Two zero biases that training leaves at zero (or any equal pair it does not change) are fine."""
    g = {"a": np.zeros(8, np.float32), "b": np.zeros(8, np.float32), "w": np.ones((4, 8), np.float32)}
    t = {"a": np.zeros(8, np.float32), "b": np.zeros(8, np.float32), "w": np.full((4, 8), 2.0, np.float32)}
    msg = train_msg(g, {"compressor": "none"})

    def handle(m, c):
        rec = ArrayRecord({k: Array(np.array(v)) for k, v in t.items()})
        return Message(content=RecordDict({"arrays": rec, "metrics": MetricRecord({"num-examples": 1})}),
                       reply_to=m)
    assert not compression_mod(msg, make_ctx(), handle).has_error()
