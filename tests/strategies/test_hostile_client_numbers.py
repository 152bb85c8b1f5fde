"""Regression tests for problems found by attacking the app (each with the right value)."""

import json
import math

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, MetricRecord
from flwr.serverapp.strategy import FedAvg

import fedcomp.compression as fc
from fedcomp.compression.wire import pack_header
from fedcomp.config import AppConfig
from fedcomp.strategies import CompressedStrategy

from tests.messages import weights
from .test_compressed import compressed_reply, fedavg, setup


def _set_metrics(reply, **kv):
    m = dict(reply.content["metrics"])
    m.update(kv)
    reply.content["metrics"] = MetricRecord(m)
    return reply


def test_a_client_with_an_extra_metric_does_not_abort_the_round():
    g, t1, t2 = weights(0), weights(1), weights(2)
    s = CompressedStrategy(fedavg(), compressor="none")
    setup(s, g)
    arrays, m = s.aggregate_train(1, [compressed_reply(g, t1, 1, n=10),
                                      _set_metrics(compressed_reply(g, t2, 2, n=30), foo=1.0)])
    assert m["num-replies"] == 2 and "foo" not in m
    assert np.allclose(arrays["w"].numpy(), (10 * t1["w"] + 30 * t2["w"]) / 40, atol=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -9, 0, 2.5, 1e30, [1, 2]])
def test_bad_num_examples_is_rejected(bad):
    g, t1, t2 = weights(0), weights(1), weights(2)
    s = CompressedStrategy(fedavg(), compressor="none")
    setup(s, g)
    arrays, m = s.aggregate_train(1, [compressed_reply(g, t1, 1, n=10),
                                      _set_metrics(compressed_reply(g, t2, 2), **{"num-examples": bad})])
    assert m["rejected-replies"] == 1 and m["num-replies"] == 1
    assert np.allclose(arrays["w"].numpy(), t1["w"], atol=1e-6)


def test_non_finite_client_metrics_are_dropped_and_results_are_strict_json(tmp_path):
    from fedcomp.server.results import write_json

    g, t = weights(0), weights(1)
    s = CompressedStrategy(fedavg(), compressor="none")
    setup(s, g)
    _, m = s.aggregate_train(1, [_set_metrics(compressed_reply(g, t, 1), **{"train-loss": float("inf")})])
    assert all(math.isfinite(v) for v in m.values() if isinstance(v, float))
    write_json(tmp_path / "m.json", {"a": float("nan"), "b": [1.0, float("inf")]})
    assert json.loads((tmp_path / "m.json").read_text()) == {"a": None, "b": [1.0, None]}


def test_selection_from_run_config_reaches_the_clients():
    from flwr.app import ArrayRecord

    from fedcomp.client.app import app as client_app
    from fedcomp.models import build_model
    from fedcomp.simulation import InProcessGrid

    cfg = AppConfig.from_run_config({"compressor": "topk", "selection": "tensor"})
    s = CompressedStrategy.from_codec_config(FedAvg(min_available_nodes=2), cfg.codec)
    assert s.codec.scope == "tensor"
    msgs = list(s.configure_train(1, ArrayRecord(build_model().state_dict()), ConfigRecord(),
                                  InProcessGrid(client_app, 2, {})))
    assert msgs[0].content["config"]["selection"] == "tensor"


def test_fp16_residual_saturates_instead_of_becoming_inf():
    ef = fc.ErrorFeedback(fc.get_compressor("topk", density=0.1), residual_dtype="fp16")
    ef.compress(torch.full((10,), 1e6))
    assert bool(torch.isfinite(ef.residual).all()) and float(ef.residual.max()) == 65504.0
    ef.compress(torch.zeros(10))  # the next round still works


@pytest.mark.parametrize("name,value", [("sign", 1e38), ("bf16", 3.4e38), ("int8", float(np.finfo(np.float32).max))])
def test_huge_finite_inputs_decode_to_finite_values(name, value):
    for seed in range(5):
        params = {"seed": seed} if name == "int8" else {}
        out = fc.decompress(fc.get_compressor(name, **params).compress(torch.full((10,), value)))
        assert bool(torch.isfinite(out).all())
        assert float(out.min()) > 0.5 * value


def test_float64_beyond_float32_range_is_named_as_such():
    with pytest.raises(ValueError, match="beyond the float32 range"):
        fc.get_compressor("sign").compress(torch.full((3,), 1e300, dtype=torch.float64))


def test_decompress_odd_inputs_raise_payload_error_or_work():
    with pytest.raises(fc.PayloadError, match="dimension"):
        fc.decompress(pack_header(0, torch.float32, (0, 2**63), b""))
    p = fc.get_compressor("none").compress(torch.arange(4.0))
    strided = memoryview(bytes(b for pair in zip(p, p) for b in pair))[::2]
    assert torch.equal(fc.decompress(strided), torch.arange(4.0))


def test_qsgd_and_int8_block_decoding_handles_tails_and_huge_blocks():
    x = torch.randn(1000)
    for bs in (1, 7, 999, 1000, 1001, 2**31 - 1):
        out = fc.decompress(fc.get_compressor("int8", block_size=bs, seed=0).compress(x))
        assert torch.all((out - x).abs() <= x.abs().max() / 127 * (1 + 1e-5))
        q = fc.decompress(fc.get_compressor("qsgd", bucket_size=bs, levels=255, seed=0).compress(x))
        assert q.shape == x.shape and bool(torch.isfinite(q).all())
