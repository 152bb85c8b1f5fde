"""Compression policies: per-layer codecs, small tensors, warm-up, density schedules, adaptive
density, mixed clients, per-layer monitoring."""

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import FedAvg

import fedcomp.compression as fc
from fedcomp.client.update import adaptive_density, compress_update, plan_units
from fedcomp.config import CODEC_DEFAULTS, CodecConfig
from fedcomp.protocol.messages import MODEL_KEY
from fedcomp.strategies import CompressedStrategy

SHAPES = {"conv1.weight": (16, 1, 3, 3), "conv1.bias": (16,), "fc1.weight": (64, 512), "fc1.bias": (64,),
          "fc2.weight": (10, 64), "fc2.bias": (10,)}


def test_rules_first_match_wins_then_small_tensors_then_default():
    c = CodecConfig(compressor="stc", layer_codecs="conv*=int8, fc2.*=sign, fc2.bias=none",
                    min_compress_numel=100, small_tensor_compressor="fp16")
    units = plan_units(SHAPES, c)
    assert units == [("conv1.weight", ["conv1.weight"], "int8"), ("conv1.bias", ["conv1.bias"], "int8"),
                     ("fc1.bias", ["fc1.bias"], "fp16"), ("fc2.weight", ["fc2.weight"], "sign"),
                     ("fc2.bias", ["fc2.bias"], "sign"), (MODEL_KEY, ["fc1.weight"], "stc")]


def test_payloads_use_the_planned_codecs_and_the_server_rebuilds_them():
    rng = np.random.default_rng(0)
    g = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    t = {k: v + 0.01 * rng.standard_normal(v.shape).astype(np.float32) for k, v in g.items()}
    c = CodecConfig(compressor="topk", density=1.0, layer_codecs="conv*=none", min_compress_numel=100)
    payloads, _, stats = compress_update(g, t, c, {})
    assert {k: fc.codec_name(p) for k, p in payloads.items()} == {
        "conv1.weight": "none", "conv1.bias": "none", "fc1.bias": "none", "fc2.bias": "none", MODEL_KEY: "topk"}
    from flwr.app import Array

    from fedcomp.protocol.messages import PAYLOAD_DTYPE, PAYLOAD_STYPE
    from fedcomp.strategies.decode import decode_update

    rec = ArrayRecord({k: Array(dtype=PAYLOAD_DTYPE, shape=(len(p),), stype=PAYLOAD_STYPE, data=p)
                       for k, p in payloads.items()})
    w, info = decode_update(rec, g)
    assert list(w) == list(g)
    for k in g:
        assert np.allclose(w[k], t[k], atol=1e-6)
    assert set(info["codecs"]) == {"none", "topk"}
    assert len(stats["layer-update-norm"]) == len(SHAPES) == len(stats["layer-compression-error"])
    assert stats["layer-compression-error"] == pytest.approx([0.0] * 6, abs=1e-6)


def test_rule_matching_no_parameter_is_a_start_up_error():
    from fedcomp.app.client_app import app as client_app
    from fedcomp.task.models import build_model
    from fedcomp.run.inprocess_grid import InProcessGrid

    s = CompressedStrategy(FedAvg(min_available_nodes=2), compressor="stc", layer_codecs="decoder.*=int8")
    with pytest.raises(ValueError, match="'decoder.\\*=int8' matches no parameter"):
        s.configure_train(1, ArrayRecord(build_model().state_dict()), ConfigRecord(), InProcessGrid(client_app, 2, {}))
    with pytest.raises(ValueError, match="unknown codec 'gzip'"):
        CodecConfig.from_mapping({"layer-codecs": "conv*=gzip"})
    with pytest.raises(ValueError, match="pattern=codec"):
        CodecConfig.from_mapping({"layer-codecs": "conv*"})


def test_warmup_then_exponential_schedule_matches_dgc():
    c = CodecConfig.from_mapping({"compressor": "stc", "warmup-rounds": 2, "warmup-compressor": "fp16",
                                  "density-schedule": "exponential", "density-start": 0.25, "density": 0.001,
                                  "schedule-rounds": 5})
    got = [(c.for_round(r).compressor, c.for_round(r).density) for r in range(1, 9)]
    assert [g[0] for g in got] == ["fp16", "fp16"] + ["stc"] * 6
    assert [g[1] for g in got[2:]] == pytest.approx([0.25, 0.0625 * 1.0059, 0.015811, 0.0039764, 0.001, 0.001],
                                                     rel=2e-3)
    # DGC: 25 % -> 6.25 % -> 1.5625 % -> 0.4 % -> 0.1 %: each step divides by (250)**(1/4) = 3.976
    steps = [got[i][1] / got[i + 1][1] for i in range(2, 6)]
    assert steps == pytest.approx([250 ** 0.25] * 4, rel=1e-9)


def test_linear_schedule():
    c = CodecConfig(density_schedule="linear", density_start=0.5, density=0.1, schedule_rounds=5)
    assert [c.for_round(r).density for r in range(1, 7)] == pytest.approx([0.5, 0.4, 0.3, 0.2, 0.1, 0.1])


def test_adaptive_density_meets_its_target_with_the_smallest_k():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(20000, generator=g) * torch.rand(20000, generator=g) ** 4  # heavy-tailed update
    for name, target in (("topk", 0.5), ("stc", 0.8)):  # STC's ternary values cannot go below ~0.75 here
        d = adaptive_density(v, name, target, 0.001, 0.5)
        assert d < 0.5
        err = fc.compression_error(v, fc.decompress(fc.get_compressor(name, density=d).compress(v)))
        assert err <= target + 1e-6
        smaller = d - 1 / v.numel()
        err_smaller = fc.compression_error(v, fc.decompress(fc.get_compressor(name, density=smaller).compress(v)))
        assert err_smaller > target - 1e-6
    assert adaptive_density(v, "topk", 1e-9, 0.001, 0.01) == 0.01  # infeasible: the maximum
    assert adaptive_density(torch.zeros(10), "stc", 0.5, 0.1, 0.5) == 0.1


def test_configure_train_sends_the_codec_in_force_each_round():
    from fedcomp.app.client_app import app as client_app
    from fedcomp.task.models import build_model
    from fedcomp.run.inprocess_grid import InProcessGrid

    s = CompressedStrategy(FedAvg(min_available_nodes=2, fraction_evaluate=0.0), compressor="stc", density=0.01,
                           warmup_rounds=1, density_schedule="linear", density_start=0.1, schedule_rounds=2)
    grid = InProcessGrid(client_app, 2, {})
    arrays = ArrayRecord(build_model().state_dict())
    sent = [dict(list(s.configure_train(r, arrays, ConfigRecord(), grid))[0].content["config"]) for r in (1, 2, 3)]
    density = [c.get("density", CODEC_DEFAULTS["density"]) for c in sent]  # a default value is not sent
    assert [(c["compressor"], d) for c, d in zip(sent, density)] == [("none", 0.01), ("stc", 0.1), ("stc", 0.01)]


def test_mixed_sign_and_topk_federation_trains_and_reports_bytes_per_codec():
    import logging

    from fedcomp.app.client_app import app as client_app
    from fedcomp.task.models import build_model
    from fedcomp.run.inprocess_grid import InProcessGrid

    logging.getLogger("flwr").setLevel(logging.WARNING)
    grid = InProcessGrid(client_app, 4, {"lr": 0.1}, node_configs=[{"compressor": "sign"}, {"compressor": "sign"},
                                                                   {}, {}])
    s = CompressedStrategy(FedAvg(min_available_nodes=4, fraction_evaluate=0.0), compressor="topk", density=0.05)
    start = ArrayRecord(build_model().state_dict())
    res = s.start(grid=grid, initial_arrays=start, num_rounds=3, train_config=ConfigRecord({"seed": 1}))
    h = s.history[3]
    assert h["num-replies"] == 4 and h["upload-bytes-sign"] > 0 and h["upload-bytes-topk"] > 0
    assert h["upload-bytes"] == h["upload-bytes-sign"] + h["upload-bytes-topk"]
    moved = sum(float(np.abs(res.arrays[k].numpy() - start[k].numpy()).sum()) for k in start.keys())
    assert moved > 0
    assert s.layer_history[3] == {}  # per-layer figures are asked for in round 1 and every 10th round
    layers = s.layer_history[1]
    assert set(layers) == set(start.keys())
    assert all(v["update-norm"] > 0 and 0 <= v["compression-error"] <= 1.5 for v in layers.values())
