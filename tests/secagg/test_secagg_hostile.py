"""Hostile clients and operator mistakes on the SecAgg+ path (review of 2026-12-01)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from flwr.common import ndarray_to_bytes

from fedcomp.secagg.protocol_packing import pack_masked
from tests.secagg import helpers

_tampering_grid = helpers.tampering_grid


class _Pickled:
    pass


def _pickled_npy(n: int) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.array([_Pickled()] * n, dtype=object), allow_pickle=True)
    return buf.getvalue()


@pytest.mark.parametrize("fn", [
    lambda bl: [bl[0]],                                                    # one blob instead of two
    lambda bl: [bl[0], ndarray_to_bytes(np.zeros(7, np.int64))],           # well-formed npy, wrong length
    lambda bl: [bl[0], ndarray_to_bytes(np.zeros(1025, np.float64))],      # float masked vector
    lambda bl: [bl[0], b"hello"],                                          # not npy, not packed
    lambda bl: [bl[0], ndarray_to_bytes(np.full(1025, -1, np.int64))],     # right shape, values out of range
    lambda bl: [bl[0], _pickled_npy(1025)],  # pickled objects
    lambda bl: [bl[0], pack_masked(np.zeros(1, np.int64), bl[1][5])],      # packed, wrong shape
], ids=["one-blob", "npy-wrong-length", "float64", "not-npy", "out-of-range", "pickle", "packed-wrong-shape"])
def test_secagg_malformed_masked_vector_is_a_dropout_not_a_crash(monkeypatch, fn):
    monkeypatch.setattr(helpers, "RecordingGrid", _tampering_grid(fn))
    new, strategy, workflow, _ = helpers.run_round(5, 0.5)
    assert strategy.history[1]["num-replies"] == 4
    assert workflow.round_bytes["malformed-replies"] == 1
    assert all(np.isfinite(v).all() for v in new.values())


def _decoding_strategy(inner, max_weight=None):
    from fedcomp.secagg import SharedRandomKStrategy
    from fedcomp.secagg.encoding import SharedProjection
    s = SharedRandomKStrategy(inner, 1.0, max_weight=max_weight)
    s._global, s._proj, s._sampled = [np.ones(4, np.float32)], SharedProjection(4, 1.0, 1), 2
    return s


def _fitres(n, value=0.1):
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters([np.full(4, value)]), n, {})


@pytest.mark.parametrize("inner", ["FedAvg", "FedAvgM"])
@pytest.mark.parametrize("ns", [(500, -500), (500, 0), (500, 10**6), (500, 1.5)], ids=["negative", "zero", "above-max",
                                                                                          "float"])
def test_secagg_server_refuses_num_examples_outside_1_max_weight(inner, ns):
    import flwr.server.strategy as legacy
    s = _decoding_strategy(getattr(legacy, inner)(), max_weight=1000.0)
    agg, _ = s.aggregate_fit(1, [(None, _fitres(n)) for n in ns], [])
    assert agg is None


def test_secagg_without_max_weight_still_refuses_non_positive_num_examples():
    from flwr.server.strategy import FedAvgM
    agg, _ = _decoding_strategy(FedAvgM()).aggregate_fit(1, [(None, _fitres(500)), (None, _fitres(-500))], [])
    assert agg is None


def test_secagg_accepts_num_examples_within_bounds():
    from flwr.common import parameters_to_ndarrays
    from flwr.server.strategy import FedAvg
    agg, _ = _decoding_strategy(FedAvg(), 1000.0).aggregate_fit(1, [(None, _fitres(1)), (None, _fitres(1000))], [])
    np.testing.assert_allclose(parameters_to_ndarrays(agg)[0], np.full(4, 1.1, np.float32))


def test_secagg_non_finite_aggregate_drops_the_round_not_the_run():
    from flwr.server.strategy import FedAvg
    s = _decoding_strategy(FedAvg(), 1000.0)
    agg, _ = s.aggregate_fit(1, [(None, _fitres(10, np.nan))], [])
    assert agg is None
    agg, _ = s.aggregate_fit(1, [(None, _fitres(10, 1e300))], [])   # overflows float32
    assert agg is None


def test_secagg_non_finite_inner_aggregate_drops_the_round():
    from flwr.common import ndarrays_to_parameters
    from flwr.server.strategy import FedAvg

    class Bad(FedAvg):
        def aggregate_fit(self, rnd, results, failures):
            return ndarrays_to_parameters([np.full(4, np.inf)]), {}
    agg, _ = _decoding_strategy(Bad(), 1000.0).aggregate_fit(1, [(None, _fitres(10))], [])
    assert agg is None


def test_workflow_gives_the_strategy_its_max_weight():
    new, strategy, workflow, _ = helpers.run_round(3, 0.5)
    assert strategy.max_weight == workflow.max_weight == 1000.0
    assert strategy.history[1]["num-replies"] == 3


@pytest.mark.parametrize("value", ["true", 1, "false", 0])
def test_secagg_flag_must_be_a_boolean(value):
    from fedcomp.app.config import AppConfig
    from fedcomp.app.secagg_server_app import secagg_requested
    with pytest.raises(ValueError, match="'secagg' must be true or false"):
        AppConfig.from_run_config({"secagg": value, "compressor": "randomk"})
    with pytest.raises(ValueError, match="'secagg' must be true or false"):
        secagg_requested({"secagg": value})


def test_secagg_flag_is_checked_by_the_simulation_precheck():
    import pathlib

    from fedcomp.run.simulation import check_run_config
    root = pathlib.Path(__file__).resolve().parents[2]
    with pytest.raises(ValueError, match="'secagg' must be true or false"):
        check_run_config(root, 'secagg="true" compressor="randomk"')
    with pytest.raises(ValueError, match="'compressor' = 'topk' cannot work under secure aggregation"):
        check_run_config(root, 'secagg=true compressor="topk"')
    assert check_run_config(root, 'secagg=true compressor="randomk"')["secagg"] is True
    assert check_run_config(root, "secagg=true")["secagg"] is True  # the default codec resolves to the secure one


def test_secagg_clipping_range_beyond_float64_resolution_is_refused():
    from fedcomp.config.secagg import SecAggConfig
    for c, bits in ((1e30, 16), (2.0 ** 36, 16), (2.0 ** 51, 1)):
        with pytest.raises(ValueError, match="'secagg-clipping-range'"):
            SecAggConfig.from_run_config({"secagg-clipping-range": c, "secagg-quantization-bits": bits})
    assert SecAggConfig.from_run_config({"secagg-clipping-range": 2.0 ** 35}).clipping_range == 2.0 ** 35


@pytest.mark.parametrize("key,value", [("finetune", "lora"), ("selection", "model"), ("min-compress-numel", 100),
                                       ("small-tensor-compressor", "fp16"), ("require-compression", True)])
def test_secagg_refuses_settings_the_secure_path_ignores(key, value):
    from fedcomp.app.secagg_server_app import check_secagg_config
    base = {"secagg": True, "compressor": "randomk"}
    check_secagg_config({**base, key: {"finetune": "full", "selection": "auto", "min-compress-numel": 0,
                                       "small-tensor-compressor": "none", "require-compression": False}[key]})
    with pytest.raises(ValueError, match=f"'{key}' = {value!r} is not supported with secagg"):
        check_secagg_config({**base, key: value})


@pytest.mark.parametrize("loss", [1e308, float("inf"), float("nan"), -1e308])
def test_secagg_metrics_are_bounded_like_the_plain_path(loss):
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.server.strategy import FedAvg

    from fedcomp.secagg import SharedRandomKStrategy
    from fedcomp.secagg.encoding import SharedProjection
    from fedcomp.strategies.round_metrics import METRIC_BOUND
    s = SharedRandomKStrategy(FedAvg(), 0.5)
    s._proj, s._sampled = SharedProjection(10, 0.5, 1), 2
    fr = lambda m: FitRes(Status(Code.OK, ""), ndarrays_to_parameters([np.zeros(5)]), 500, m)
    m = s._round_metrics([(None, fr({"train-loss": loss, "compression-error": loss})),
                          (None, fr({"train-loss": 1.0, "compression-error": 1.0}))], [])
    for key in ("train-loss", "compression-error"):
        assert np.isfinite(m[key]) and abs(m[key]) <= METRIC_BOUND


def test_secagg_batchnorm_running_var_is_clamped_at_zero():
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.strategy import FedAvg

    from fedcomp.secagg import SharedRandomKStrategy
    from fedcomp.secagg.encoding import SharedProjection
    s = SharedRandomKStrategy(FedAvg(), 1.0, keys=["bn.weight", "bn.running_var"], max_weight=1000.0)
    s._global = [np.ones(2, np.float32), np.full(2, 1e-4, np.float32)]
    s._proj, s._sampled = SharedProjection(4, 1.0, 1), 1
    fr = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([np.array([-0.5, 0.5, -5e-4, 5e-4])]), 10, {})
    w, rv = parameters_to_ndarrays(s.aggregate_fit(1, [(None, fr)], [])[0])
    np.testing.assert_allclose(w, [0.5, 1.5])                       # other tensors may go below 0
    np.testing.assert_allclose(rv, [0.0, 6e-4], rtol=1e-6)


def test_a_round_halted_for_modulus_overflow_stops_the_run_with_the_reason(monkeypatch):
    import functools

    from fedcomp.secagg import CompressedSecAggPlusWorkflow, SecAggHalted
    monkeypatch.setattr(helpers, "CompressedSecAggPlusWorkflow",
                        functools.partial(CompressedSecAggPlusWorkflow, modulus_bits=18))  # 5 * 2**16 >= 2**18
    with pytest.raises(SecAggHalted, match=r"5 sampled clients can overflow modulus 2\*\*18.*'secagg-modulus-bits'"):
        helpers.run_round(5, 0.5)
