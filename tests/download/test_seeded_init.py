"""``Download(init="seeded")`` redraws only what looks like a parameter's random draw: fixed float
buffers (a sinusoidal positional table, a causal mask) keep their values, on the server and on every
new client, and travel beside the seed."""

import math

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, RecordDict
from torch import nn

from fedcomp.download.receiver import rebuild
from fedcomp.config import CodecConfig
from fedcomp.download.seeded_init import looks_drawn, seeded_like
from fedcomp.statedict import to_record, to_state_dict
from fedcomp.download.sender import Downstream
from tests.messages import make_ctx, make_msg


def sinusoidal(positions: int, dim: int) -> torch.Tensor:
    pos = torch.arange(positions, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    pe = torch.zeros(positions, dim)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
    return pe


class TinyDecoder(nn.Module):
    """An embedding, a projection and a head, with a registered sinusoidal table and causal mask."""

    def __init__(self, vocab: int = 50, dim: int = 16, context: int = 32):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("pe", sinusoidal(context, dim))
        self.register_buffer("mask", torch.triu(torch.full((context, context), -1e4), diagonal=1))


def _first_contact(ds: Downstream, record, node: int = 7):
    msg = make_msg(RecordDict({"arrays": record, "config": ConfigRecord({"server-round": 1})}), dst=node)
    ds.prepare(1, record, [msg])
    rebuilt = rebuild(msg, make_ctx(node_id=node), "arrays", msg.content["arrays"], dict(msg.content["config"]))
    ds.received(node)
    return to_state_dict(rebuilt), ds.sent_bytes[node], ds.sent_kind[node]


@pytest.mark.parametrize("downstream", ["stc", "sign", "int8"])
def test_the_seeded_start_keeps_fixed_buffers_and_redraws_parameters(downstream):
    torch.manual_seed(0)
    sd = TinyDecoder().state_dict()
    ds = Downstream(CodecConfig(compressor="stc"), downstream, init="seeded")
    start = to_state_dict(ds.start_model(to_record(sd)))
    assert ds.init.exact == frozenset({"pe", "mask"})
    assert start["pe"][0].tolist() == [0.0, 1.0] * 8 and torch.equal(start["pe"], sd["pe"])
    assert torch.equal(start["mask"], sd["mask"]) and set(start["mask"].unique().tolist()) == {0.0, -1e4}
    for k in ("wte.weight", "proj.weight", "proj.bias", "head.weight"):
        assert not torch.equal(start[k], sd[k]), k  # redrawn with the same mean and variance
        assert abs(float(start[k].std()) / float(sd[k].std()) - 1) < 0.25, k
    assert torch.equal(start["norm.weight"], sd["norm.weight"]) and torch.equal(start["norm.bias"], sd["norm.bias"])
    rebuilt, sent, kind = _first_contact(ds, to_record(start))
    assert kind == "init"
    for k, t in start.items():
        assert torch.equal(rebuilt[k], t), k  # bit for bit, the buffers exact
    buffer_bytes = 4 * (sd["pe"].numel() + sd["mask"].numel())
    params_bytes = 4 * sum(t.numel() for k, t in sd.items() if k not in ("pe", "mask"))
    assert sent < buffer_bytes * 1.1 + 2000 and sent < 0.6 * (buffer_bytes + params_bytes)


def test_a_model_without_fixed_buffers_sends_rules_and_its_tiny_tensors():
    """A tensor of fewer than 16 entries cannot be told from a fixed one: it travels exactly (its bytes)."""
    torch.manual_seed(1)
    sd = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)).state_dict()
    ds = Downstream(CodecConfig(compressor="stc"), "stc", init="seeded")
    start = to_state_dict(ds.start_model(to_record(sd)))
    assert ds.init.exact == frozenset({"2.bias"}) and torch.equal(start["2.bias"], sd["2.bias"])
    rebuilt, sent, kind = _first_contact(ds, to_record(start))
    assert kind == "init" and sent < 100 * len(sd) + 4 * 10
    assert all(torch.equal(rebuilt[k], start[k]) for k in start)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pytorch_initialisations_look_drawn_and_buffers_do_not(dtype):
    torch.manual_seed(2)
    drawn = [nn.Linear(64, 128).weight, nn.Linear(64, 128).bias, nn.Conv2d(3, 16, 3).weight,
             nn.Embedding(100, 32).weight, nn.init.xavier_uniform_(torch.empty(40, 40)),
             nn.init.orthogonal_(torch.empty(32, 32)), nn.init.trunc_normal_(torch.empty(500), std=0.02)]
    for t in drawn:
        assert looks_drawn(t.detach().to(dtype).float().numpy() if dtype != torch.float32 else t.detach().numpy())
    fixed = [sinusoidal(64, 32), torch.triu(torch.full((16, 16), -1e4), diagonal=1), torch.ones(100),
             torch.arange(100.0), (torch.rand(200) > 0.5).float(), torch.randn(10)]
    for t in fixed:
        assert not looks_drawn(t.to(dtype).float().numpy())


def test_seeded_like_keeps_the_exact_tensors_out_of_the_draw():
    arrays = {"w": np.random.default_rng(0).standard_normal(100).astype(np.float32),
              "pe": sinusoidal(8, 4).numpy(), "one": np.ones(3, np.float32)}
    init = seeded_like(arrays, seed=1, exact=["pe", "one"])
    assert init.exact == frozenset({"pe"})  # a constant keeps its exact constant rule
    assert init.bounds["pe"] == 0.0 and "pe" not in init.centers and init.centers["one"] == 1.0
    with pytest.raises(ValueError, match="not in the model"):
        seeded_like(arrays, seed=1, exact=["missing"])
