"""Every state_dict a PyTorch model can have goes through mod -> strategy -> downstream exactly.

A zoo of small models: BatchNorm1d/2d, LayerNorm, GroupNorm, a 0-d parameter, a zero-element
parameter, int64/uint8/bool buffers, an fp16 and a bf16 model. Two clients "train" (float
tensors move a little, integer/bool buffers take chosen values) and the round is aggregated.
"""

import logging

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from torch import nn

import fedcomp.compression as fc
from fedcomp.client import compression_mod
from fedcomp.statedict import FlatModel, to_record, to_state_dict
from fedcomp.strategies import CompressedStrategy
from tests.messages import make_ctx, make_msg
from tests.model_zoo import ZOO, expected_exact, trained_state, zoo, zoo_round

logging.getLogger("flwr").setLevel(logging.WARNING)


CODECS = ["none", "fp16", "sign", "stc", "topk", "randomk", "randsign", "qsgd", "int8"]


@pytest.mark.parametrize("selection", ["tensor", "model"])
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("name", ZOO)
def test_zoo_round_trip_keeps_dtypes_shapes_and_exact_integers(name, codec, selection):
    model = zoo()[name]
    sd, arrays, metrics = zoo_round(model, codec, selection)
    assert arrays is not None and metrics["rejected-replies"] == 0
    out = to_state_dict(arrays)
    assert list(out) == list(sd)
    for k, t in sd.items():
        assert out[k].dtype == t.dtype, k
        assert tuple(out[k].shape) == tuple(t.shape), k
        if t.is_floating_point():
            assert bool(torch.isfinite(out[k].float()).all()), k
    for k, want in expected_exact(sd).items():
        assert out[k].tolist() == want, k
    model.load_state_dict(out)  # fits the model as it is


@pytest.mark.parametrize("name", ZOO)
def test_zoo_uncompressed_round_is_the_weighted_mean(name):
    sd, arrays, _ = zoo_round(zoo()[name], "none", "tensor")
    out = to_state_dict(arrays)
    t0, t1 = trained_state(sd, 0), trained_state(sd, 1)
    for k, t in sd.items():
        if t.is_floating_point():
            want = (10 * t0[k].float() + 30 * t1[k].float()) / 40
            tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(t.dtype, 1e-6)
            assert torch.allclose(out[k].float(), want, atol=tol, rtol=tol), k


@pytest.mark.parametrize("name", ZOO)
def test_zoo_downstream_rebuilds_every_tensor_exactly(name):
    from fedcomp.download.receiver import rebuild
    from fedcomp.config import CodecConfig
    from fedcomp.download.sender import Downstream

    sd = zoo()[name].state_dict()
    ds = Downstream(CodecConfig(compressor="none"), "fp16")
    ctx = make_ctx(node_id=5)
    for rnd, weights in ((1, sd), (2, trained_state(sd, 1))):
        msg = make_msg(RecordDict({"arrays": to_record(weights), "config": ConfigRecord({"server-round": rnd})}),
                       dst=5)
        ds.prepare(rnd, to_record(weights), [msg])
        if rnd == 2:
            assert "fedcomp.model" in msg.content["arrays"]  # a payload, not dense
        rebuilt = to_state_dict(rebuild(msg, ctx, "arrays", msg.content["arrays"], dict(msg.content["config"])))
        ds.received(5)
        for k, t in weights.items():
            assert rebuilt[k].dtype == t.dtype and tuple(rebuilt[k].shape) == tuple(t.shape), k
            if not t.is_floating_point():
                assert torch.equal(rebuilt[k], t), k  # integers and bools arrive exactly
            else:  # fp16 downstream codec: fp16 rounding of the change
                assert torch.allclose(rebuilt[k].float(), t.float(), atol=2e-2, rtol=1e-2), k


def test_an_fp16_client_that_overflows_is_the_one_rejected():
    """One fp16 reply that overflows is rejected alone; the round goes on with the other replies."""
    model = nn.Sequential(nn.Linear(6, 4)).half()
    sd = model.state_dict()
    strategy = CompressedStrategy(FedAvg(fraction_evaluate=0.0), compressor="none")
    strategy.remember(1, FlatModel.from_record(to_record(sd)))
    replies = []
    for client in (0, 1):
        msg = make_msg(RecordDict({"arrays": to_record(sd), "config": ConfigRecord(
            {"server-round": 1, **strategy.codec.to_mapping()})}), dst=20 + client)

        def handler(m, c):
            return Message(content=RecordDict({"arrays": to_record(sd), "metrics": MetricRecord({"num-examples": 5})}),
                           reply_to=m)

        reply = compression_mod(msg, make_ctx(node_id=20 + client), handler)
        if client == 1:  # a decoded update that is finite in fp32 but overflows fp16 once applied (> 65504)
            payload = fc.get_compressor("none").compress(torch.full((4, 6), 70000.0))
            arrs = dict(reply.content["arrays"].items())
            arrs["0.weight"] = Array(dtype="bytes", shape=(len(payload),), stype="fedcomp.payload.v1", data=payload)
            reply.content["arrays"] = ArrayRecord(arrs)
        replies.append(reply)
    arrays, _ = strategy.aggregate_train(1, replies)
    metrics = strategy.history[1]  # the round's own figures (Flower gets the headline ones)
    assert metrics["rejected-replies"] == 1 and metrics["num-replies"] == 1
    assert arrays is not None  # the round goes on with the good client
    assert to_state_dict(arrays)["0.weight"].dtype == torch.float16


def test_a_reply_with_the_keys_in_another_order_is_accepted():
    """A reply with the same keys in another order is accepted (not "missing [], extra []")."""
    from fedcomp.client.update import compress_update
    from fedcomp.config import CodecConfig

    g = {"a": np.zeros(3, np.float32), "b": np.ones(2, np.float32), "n": np.array(3, np.int64)}
    t = {"n": np.array(4, np.int64), "b": np.full(2, 2.0, np.float32), "a": np.full(3, 0.5, np.float32)}
    payloads, _, _ = compress_update(g, t, CodecConfig(compressor="none", error_feedback=False), {})
    assert list(payloads) == ["a", "b", "n"]
    assert fc.decompress(payloads["b"]).tolist() == [1.0, 1.0]
    assert int(fc.decode_exact(payloads["n"], (), np.int64)) == 4


@pytest.mark.parametrize("name", ZOO)
def test_zoo_checkpoint_keeps_every_tensor(tmp_path, name):
    """Checkpoint save/load of every zoo state_dict: exact values, dtypes and shapes (0-d and (0, 5)
    included). bf16 tensors are saved as their float32 values (numpy has no bfloat16)."""
    from fedcomp.app import checkpoint
    from fedcomp.statedict import numpy_dict

    sd = trained_state(zoo()[name].state_dict(), 1)
    weights, dtypes = numpy_dict(to_record(sd))
    strategy = CompressedStrategy(FedAvg(fraction_evaluate=0.0), compressor="none")
    checkpoint.save(tmp_path, 3, weights, strategy, [{"round": 3}])
    rnd, loaded, _ = checkpoint.load(tmp_path, strategy, {k: v.shape for k, v in weights.items()})
    assert rnd == 3 and list(loaded) == list(weights)
    for k, v in weights.items():
        assert loaded[k].dtype == v.dtype and loaded[k].shape == v.shape, k
        assert np.array_equal(loaded[k], v), k


def test_integer_rule_at_the_ends_of_the_range_neither_rounds_nor_wraps():
    """Regression: float64 clipping rounded int64 2**63-1 up and the cast wrapped it to -2**63."""
    from fedcomp.statedict import integer_mean

    assert int(integer_mean(np.array(2**63 - 1, np.int64), np.array(0.0), 1.0)) == 2**63 - 1
    assert int(integer_mean(np.array(2**64 - 1, np.uint64), np.array(0.0), 1.0)) == 2**64 - 1
    assert int(integer_mean(np.array(2**53 + 1, np.int64), np.array(0.0), 1.0)) == 2**53 + 1
    assert integer_mean(np.array([2**63 - 5, 3], np.int64), np.array([100.0, -10.0]), 1.0).tolist() == [2**63 - 1, -7]
    assert integer_mean(np.array([250, 3], np.uint8), np.array([100.0, -10.0]), 1.0).tolist() == [255, 0]


def test_a_tensor_named_like_the_whole_model_payload_is_refused_clearly():
    from fedcomp.client.update import CompositionError, compress_update
    from fedcomp.config import CodecConfig

    g = {"fedcomp.model": np.zeros(3, np.float32)}
    with pytest.raises(CompositionError, match="rename"):
        compress_update(g, g, CodecConfig(), {})
    s = CompressedStrategy(FedAvg(), compressor="stc")
    with pytest.raises(ValueError, match="rename"):
        s.configure_train(1, to_record({"fedcomp.model": torch.zeros(3)}), ConfigRecord({}), None)
