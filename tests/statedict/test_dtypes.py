"""Integer tensors beyond 2**53, wider integer dtypes, the integer rule's
carried remainder, and float64 models kept float64 end to end."""

import logging
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg, FedMedian

import fedcomp.compression as fc
from fedcomp.client import compression_mod
from fedcomp.app import checkpoint
from fedcomp.statedict import FlatModel, to_record, to_state_dict
from fedcomp.strategies import CompressedStrategy
from tests.messages import make_ctx, make_msg

logging.getLogger("flwr").setLevel(logging.WARNING)


def _round(strategy, sd: dict, trained: list[dict], weights: list[int], server_round: int = 1):
    """One round through compression_mod and strategy.aggregate_train; returns the new state_dict."""
    config = {"server-round": server_round, **strategy.codec.to_mapping()}
    strategy.remember(server_round, FlatModel.from_record(to_record(sd)))
    replies = []
    for i, (t, n) in enumerate(zip(trained, weights)):
        msg = make_msg(RecordDict({"arrays": to_record(sd), "config": ConfigRecord(config)}), dst=10 + i)

        def handler(m, c, t=t, n=n):
            return Message(content=RecordDict({"arrays": to_record(t), "metrics": MetricRecord({"num-examples": n})}),
                           reply_to=m)

        replies.append(compression_mod(msg, make_ctx(node_id=10 + i), handler))
    arrays, _ = strategy.aggregate_train(server_round, replies)
    metrics = strategy.history[server_round]  # the round's own figures (Flower gets the headline ones)
    assert metrics["rejected-replies"] == 0
    return to_state_dict(arrays)


# -- Int64 beyond 2**53 moves exactly -----------------------------------------------

@pytest.mark.parametrize("codec", ["none", "stc"])
def test_int64_counters_beyond_2_pow_53_move_exactly(codec):
    sd = {"w": torch.zeros(4), "cnt": torch.tensor([2**60 + 3, -(2**53) - 2, 2**63 - 4, -(2**63) + 1])}
    moved = [{"w": torch.ones(4), "cnt": sd["cnt"] + torch.tensor([3, -1, 3, -1])} for _ in range(3)]
    out = _round(CompressedStrategy(FedAvg(), compressor=codec, density=0.5), sd, moved, [10, 20, 30])
    assert out["cnt"].dtype == torch.int64
    assert out["cnt"].tolist() == [2**60 + 6, -(2**53) - 3, 2**63 - 1, -(2**63) + 0]  # was [2**60 + 3, -2**53 - 4, ...]


def test_int64_extremes_in_opposite_directions_are_exact_and_clamped():
    sd = {"w": torch.zeros(2), "cnt": torch.tensor([-(2**63), 2**63 - 1])}
    a = {"w": torch.zeros(2), "cnt": torch.tensor([2**63 - 1, -(2**63)])}  # changes of +-(2**64 - 1)
    b = {"w": torch.zeros(2), "cnt": sd["cnt"].clone()}
    out = _round(CompressedStrategy(FedAvg(), compressor="none"), sd, [a, b], [3, 1])
    # mean change 3/4 * (2**64 - 1): exact integer arithmetic, clamped, never wrapped
    step = round(Fraction(3 * (2**64 - 1), 4))  # 3 * 2**62 - 1 (the .25 below rounds down)
    assert out["cnt"].tolist() == [-(2**63) + step, 2**63 - 1 - step]


# -- A wider integer dtype is never wrapped -------------------------------------------

@pytest.mark.parametrize("model_dtype,sent,value", [(torch.int8, torch.int16, 300), (torch.uint8, torch.int64, 263),
                                                    (torch.uint8, torch.int16, -1), (torch.bool, torch.int64, 2)])
def test_an_integer_value_outside_the_models_dtype_is_refused_naming_it(model_dtype, sent, value):
    sd = {"w": torch.zeros(3), "buf": torch.zeros(2, dtype=model_dtype)}
    trained = {"w": torch.ones(3), "buf": torch.tensor([1, value], dtype=sent)}
    strategy = CompressedStrategy(FedAvg(), compressor="none")
    with pytest.raises(ValueError, match=rf"'buf': the app returned {np.dtype(str(sent).split('.')[1])} values such as "
                                         rf"{value} for a .*refusing to wrap"):
        _round(strategy, sd, [trained], [1])


def test_a_wider_integer_dtype_whose_values_fit_is_cast_exactly():
    sd = {"w": torch.zeros(3), "buf": torch.tensor([0, 0], dtype=torch.int8)}
    trained = {"w": torch.ones(3), "buf": torch.tensor([-128, 127], dtype=torch.int64)}
    out = _round(CompressedStrategy(FedAvg(), compressor="none"), sd, [trained], [1])
    assert out["buf"].dtype == torch.int8 and out["buf"].tolist() == [-128, 127]


# -- The integer rule carries its rounding remainder -----------------------------------

def test_num_batches_tracked_stays_within_half_of_the_true_cumulative_mean_for_8_rounds():
    sd = {"w": torch.zeros(3), "bn.num_batches_tracked": torch.tensor(0)}
    strategy = CompressedStrategy(FedAvg(), compressor="none")
    weights, steps = [11, 14], [14, 15]  # true mean change 364 / 25 = 14.56 a round
    seen = []
    for rnd in range(1, 9):
        trained = [{"w": sd["w"] + 1, "bn.num_batches_tracked": sd["bn.num_batches_tracked"] + s} for s in steps]
        sd = _round(strategy, sd, trained, weights, rnd)
        seen.append(int(sd["bn.num_batches_tracked"]))
        assert abs(seen[-1] - rnd * 14.56) <= 0.5, (rnd, seen)  # rounding alone gave 15 a round: 120 vs 116.48
    assert seen == [15, 29, 44, 58, 73, 87, 102, 116]
    assert abs(float(strategy.int_remainders["bn.num_batches_tracked"]) - (116.48 - 116)) < 1e-9


def test_the_integer_remainder_survives_a_checkpoint(tmp_path):
    strategy = CompressedStrategy(FedAvg(), compressor="none")
    strategy.int_remainders = {"cnt": np.array([0.25, -0.5])}
    checkpoint.save(tmp_path, 3, {"w": np.zeros(2, np.float32), "cnt": np.zeros(2, np.int64)}, strategy, [{"round": 3}])
    fresh = CompressedStrategy(FedAvg(), compressor="none")
    checkpoint.load(tmp_path, fresh)
    assert fresh.int_remainders["cnt"].tolist() == [0.25, -0.5]


# -- Float64 stays float64 ---------------------------------------------------------

def _f64_sd():
    return {"w": torch.tensor([math.pi, 1e9 + 0.5, 3.0, 0.7], dtype=torch.float64)}


@pytest.mark.parametrize("inner", [FedAvg, FedMedian])
@pytest.mark.parametrize("selection", ["tensor", "model"])
def test_a_float64_model_with_codec_none_stays_float64_end_to_end(inner, selection):
    sd = _f64_sd()
    trained = sd["w"].clone()
    trained[2] += 2e-8
    out = _round(CompressedStrategy(inner(), compressor="none", selection=selection), sd,
                 [{"w": trained.clone()} for _ in range(3)], [5, 5, 5])
    assert out["w"].dtype == torch.float64
    assert out["w"][0].item() == math.pi and out["w"][1].item() == 1e9 + 0.5  # moved by 8.7e-8 / -0.5 before
    assert abs(out["w"][2].item() - (3.0 + 2e-8)) < 1e-15  # was lost
    assert out["w"][3].item() == 0.7


def test_dense_path_returns_a_float64_clients_value_to_the_last_bit():
    sd = {"w": torch.tensor([0.1, 0.2], dtype=torch.float64)}
    out = _round(CompressedStrategy(FedMedian(), compressor="none"), sd,
                 [{"w": torch.tensor([0.7, 0.3], dtype=torch.float64)}] * 3, [1, 1, 1])
    assert abs(out["w"][0].item() - 0.7) <= 1.2e-16  # Krum's 0.7 came back 0.699999988


def test_none_payload_of_a_float64_tensor_decodes_to_float64_and_old_float32_bodies_still_decode():
    x = torch.tensor([math.pi, 1e300, -5e-324], dtype=torch.float64)
    p = fc.get_compressor("none").compress(x)
    out = fc.decompress(p)
    assert out.dtype == torch.float64 and out.tolist() == x.tolist()
    assert len(p) == len(fc.get_compressor("none").compress(torch.zeros(3))) + 1 + 3 * 4
    old = fc.get_compressor("none").compress(x.float().clamp(-3e38, 3e38))  # float32 body
    old = old[:6] + bytes([3]) + old[7:]  # as earlier versions wrote float64 tensors: header float64, body float32
    assert fc.decompress(old).dtype == torch.float32


def test_a_float64_weight_beyond_float32_range_with_a_lossy_codec_is_a_clear_error():
    sd = {"w": torch.tensor([1e300, 1.0, 2.0, 3.0], dtype=torch.float64)}
    trained = {"w": torch.tensor([-1e300, 1.0, 2.0, 3.0], dtype=torch.float64)}
    with pytest.raises(ValueError, match="'w' reaches 2e\\+300, beyond the float32 range .* codec 'stc'"):
        _round(CompressedStrategy(FedAvg(), compressor="stc", density=0.5), sd, [trained], [1])


def test_a_float64_weight_beyond_float32_range_travels_exactly_with_codec_none():
    sd = {"w": torch.tensor([1e300, 1.0], dtype=torch.float64)}
    trained = {"w": torch.tensor([-1e300, 1.5], dtype=torch.float64)}
    out = _round(CompressedStrategy(FedAvg(), compressor="none"), sd, [trained], [1])
    assert out["w"].tolist() == [-1e300, 1.5]
