"""A zoo of small models with every kind of state_dict entry (BatchNorm1d/2d, LayerNorm, GroupNorm, a 0-d
and a zero-element parameter, int64/uint8/bool buffers, fp16 and bf16 weights), what two clients "train"
from them, the exact values the integer and bool rules give, and one round through mod and strategy."""

import numpy as np
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from torch import nn

from fedcomp.client import compression_mod
from fedcomp.statedict import FlatModel, to_record
from fedcomp.strategies import CompressedStrategy
from tests.messages import make_ctx, make_msg


class Buffers(nn.Module):
    """Integer and bool buffers next to a 0-d and a zero-element parameter."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.scale = nn.Parameter(torch.tensor(0.5))  # shape ()
        self.empty = nn.Parameter(torch.zeros(0, 5))  # zero elements
        self.register_buffer("counter", torch.tensor(2**24 + 1, dtype=torch.int64))
        self.register_buffer("levels", torch.tensor([255, 255, 255, 200], dtype=torch.uint8))
        self.register_buffer("mask", torch.tensor([False, True, True, False]))


def zoo() -> dict[str, nn.Module]:
    """Fresh models of the zoo by name."""
    return {
        "batchnorm1d": nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4)),
        "batchnorm2d": nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(12, 2)),
        "layernorm": nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8)),
        "groupnorm": nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4)),
        "buffers": Buffers(),
        "fp16": nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4)).half(),
        "bf16": nn.Sequential(nn.Linear(6, 4), nn.LayerNorm(4)).to(torch.bfloat16),
    }


ZOO = list(zoo())
WEIGHTS = (10, 30)


def trained_state(sd: dict, client: int) -> dict:
    """Client ``client``'s new state_dict: floats + small noise, integers/bools set to known values."""
    g = torch.Generator().manual_seed(client)
    out = {}
    for k, t in sd.items():
        if t.is_floating_point():
            out[k] = (t.float() + 0.01 * torch.randn(t.shape, generator=g)).to(t.dtype)
        elif k.endswith("num_batches_tracked"):
            out[k] = t + (5 if client == 0 else 9)
        elif k == "counter":
            out[k] = t + (4 if client == 0 else 8)
        elif k == "levels":
            out[k] = torch.tensor([255, 255, 255, 0] if client == 0 else [255, 255, 250, 10], dtype=torch.uint8)
        elif k == "mask":
            out[k] = torch.tensor([True, True, False, False] if client == 0 else [False, True, True, True])
        else:
            out[k] = t.clone()
    return out


def expected_exact(sd: dict) -> dict:
    """The documented rules with weights 10 and 30."""
    exp = {}
    for k, t in sd.items():
        if k.endswith("num_batches_tracked"):
            exp[k] = int(t) + round((10 * 5 + 30 * 9) / 40)  # +8
        elif k == "counter":
            exp[k] = 2**24 + 1 + round((10 * 4 + 30 * 8) / 40)  # +7, exactly (no float32 on the way)
        elif k == "levels":  # weighted mean of the values, rounded half to even, clamped, no wrap-around
            exp[k] = [255, 255, int(np.rint((255 * 10 + 250 * 30) / 40)), int(np.rint((0 * 10 + 10 * 30) / 40))]
        elif k == "mask":  # weighted majority (30 > 10); no ties here
            exp[k] = [False, True, True, True]
    return exp


def zoo_round(model: nn.Module, codec: str, selection: str):
    """One round of two clients (weights 10 and 30) through ``compression_mod`` and ``CompressedStrategy``:
    (global state_dict, aggregated ArrayRecord, round metrics)."""
    sd = model.state_dict()
    global_rec = to_record(sd)
    strategy = CompressedStrategy(FedAvg(fraction_evaluate=0.0), compressor=codec, selection=selection,
                                  density=0.5)
    config = {"server-round": 1, **strategy.codec.to_mapping()}
    strategy.remember(1, FlatModel.from_record(global_rec))
    replies = []
    for client, n in enumerate(WEIGHTS):
        msg = make_msg(RecordDict({"arrays": to_record(sd), "config": ConfigRecord(config)}), dst=10 + client)
        trained = trained_state(sd, client)

        def handler(m, c, trained=trained, n=n):
            content = RecordDict({"arrays": to_record(trained), "metrics": MetricRecord({"num-examples": n})})
            return Message(content=content, reply_to=m)

        replies.append(compression_mod(msg, make_ctx(node_id=10 + client), handler))
    assert not any(r.has_error() for r in replies)
    arrays, _ = strategy.aggregate_train(1, replies)
    metrics = strategy.history[1]  # the round's own figures (Flower gets the headline ones)
    return sd, arrays, metrics
