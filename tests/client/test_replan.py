"""Error feedback keeps its residual across every codec change the library makes.

Telescoping invariant of error feedback: after any sequence of rounds,
``sum(decoded sends) + residual == sum(updates)`` per parameter (float32 rounding), also when the
payload plan changes between rounds (warm-up codec per tensor -> stc over the whole model, density
schedules, per-layer rules, a node overriding the codec).
"""

import logging

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from fedcomp.client.replan import replan_states
from fedcomp.client.update import compress_update, plan_units
from fedcomp.compression import unflatten_states
from fedcomp.config import CodecConfig
from fedcomp.protocol.messages import MODEL_KEY, PAYLOAD_DTYPE, PAYLOAD_STYPE
from fedcomp.strategies.decode import decode_update

SHAPES = {"conv1.weight": (16, 1, 3, 3), "bn1.weight": (16,), "bn1.bias": (16,), "bn1.running_mean": (16,),
          "bn1.running_var": (16,), "fc1.weight": (64, 144), "fc1.bias": (64,), "fc2.weight": (10, 64),
          "fc2.bias": (10,), "scale": ()}


def _decoded(payloads: dict[str, bytes], zero: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    rec = ArrayRecord({k: Array(dtype=PAYLOAD_DTYPE, shape=(len(p),), stype=PAYLOAD_STYPE, data=p)
                       for k, p in payloads.items()})
    return decode_update(rec, zero)[0]


def _per_param_residual(state: dict[str, np.ndarray], codec: CodecConfig) -> dict[str, np.ndarray]:
    """The saved residual cut back into parameters along this round's plan."""
    out = {}
    for ukey, members, _ in plan_units(SHAPES, codec):
        flat, off = unflatten_states(state)[ukey]["residual"].astype(np.float64).reshape(-1), 0
        for m in members:
            n = int(np.prod(SHAPES[m])) if SHAPES[m] else 1
            out[m] = flat[off: off + n].reshape(SHAPES[m])
            off += n
    return out


def _run(base: CodecConfig, rounds: int, seed: int = 0, codecs=None):
    """Rounds of compress_update with the codec the server sends each round; returns the worst
    violation of the telescoping invariant, relative to the size of an update entry."""
    rng = np.random.default_rng(seed)
    g = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    total = {k: np.zeros(s, np.float64) for k, s in SHAPES.items()}
    sent = {k: np.zeros(s, np.float64) for k, s in SHAPES.items()}
    state: dict[str, np.ndarray] = {}
    worst = 0.0
    for rnd in range(1, rounds + 1):
        codec = codecs[rnd - 1] if codecs else base.for_round(rnd)
        delta = {k: (rng.standard_normal(s) * (3.0 if k.startswith("fc1") else 1.0)).astype(np.float32)
                 for k, s in SHAPES.items()}
        payloads, state, _ = compress_update(g, {k: g[k] + delta[k] for k in g}, codec, state, seed=rnd)
        for k, v in _decoded(payloads, g).items():
            sent[k] += v
            total[k] += delta[k]
        res = _per_param_residual(state, codec)
        worst = max(worst, max(float(np.abs(sent[k] + res[k] - total[k]).max()) for k in SHAPES))
    return worst


@pytest.mark.parametrize("warmup", ["sign", "fp16", "int8", "none", "qsgd"])
def test_invariant_holds_across_the_warmup_switch_to_stc(warmup):
    # warm-up codecs work per tensor, stc over the whole model: the plan changes at round 3
    base = CodecConfig(compressor="stc", density=0.01, warmup_rounds=2, warmup_compressor=warmup)
    assert base.for_round(2).scope == "tensor" and base.for_round(3).scope == "model"
    assert _run(base, 5) < 1e-4


def test_invariant_holds_with_a_density_schedule_and_per_layer_rules():
    base = CodecConfig(compressor="topk", density=0.005, warmup_rounds=1, warmup_compressor="sign",
                       density_schedule="exponential", density_start=0.2, schedule_rounds=3,
                       layer_codecs="fc2.*=int8", min_compress_numel=20, small_tensor_compressor="fp16")
    assert _run(base, 6) < 1e-4


def test_invariant_holds_when_a_node_switches_back_and_forth_between_plans():
    stc = CodecConfig(compressor="stc", density=0.02)
    sign = CodecConfig(compressor="sign")
    ruled = CodecConfig(compressor="stc", density=0.02, layer_codecs="conv1.*=sign, fc2.weight=qsgd")
    assert _run(stc, 6, codecs=[stc, sign, stc, ruled, sign, stc]) < 1e-4


def test_the_sign_residual_is_not_dropped_at_the_switch():
    # sign's residual carries over when stc takes over after the warm-up, not dropped
    base = CodecConfig(compressor="stc", density=0.01, warmup_rounds=1, warmup_compressor="sign")
    g = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    rng = np.random.default_rng(1)
    t1 = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    _, state, _ = compress_update(g, t1, base.for_round(1), {})
    sign_res = np.concatenate([state[k].reshape(-1) for k in SHAPES if k not in
                               ("bn1.running_mean", "bn1.running_var")])
    assert float(np.linalg.norm(sign_res)) > 1.0  # sign leaves a sizeable residual
    # round 2 with a zero update: the stc payload and its residual together hold exactly the sign residual
    payloads, state2, _ = compress_update(g, g, base.for_round(2), state)
    sent = _decoded(payloads, g)
    res2 = _per_param_residual(state2, base.for_round(2))
    for k in SHAPES:
        np.testing.assert_allclose(sent[k] + res2[k], _per_param_residual(state, base.for_round(1))[k], atol=1e-6)


def test_momentum_buffer_follows_its_parameters_and_codec_memory_stays_with_its_payload():
    shapes = {"a": (3,), "b": (2, 2), "c": ()}
    states = {MODEL_KEY: {"residual": np.arange(8, dtype=np.float32), "momentum": -np.arange(8, dtype=np.float32)}}
    units = [("a", ["a"], "sign"), ("b", ["b"], "powersgd"), ("c", ["c"], "sign")]
    out, dropped = replan_states(states, units, shapes)
    assert dropped == []
    np.testing.assert_array_equal(out["b"]["residual"], [[3, 4], [5, 6]])
    np.testing.assert_array_equal(out["b"]["momentum"], [[-3, -4], [-5, -6]])
    assert out["c"]["residual"].shape == () and float(out["c"]["residual"]) == 7.0
    # and back: per-tensor state (with PowerSGD's Q on "b") regrouped into one model payload
    out["b"]["powersgd/q"] = np.ones((2, 1), np.float32)
    back, _ = replan_states(out, [(MODEL_KEY, ["a", "b", "c"], "stc")], shapes)
    np.testing.assert_array_equal(back[MODEL_KEY]["residual"], np.arange(8))
    assert set(back[MODEL_KEY]) == {"residual", "momentum"}
    # an unchanged plan keeps everything as it was, the codec memory included
    same, _ = replan_states(out, units, shapes)
    assert same["b"]["powersgd/q"] is out["b"]["powersgd/q"]


def test_missing_pieces_start_at_zero_and_fp16_residuals_stay_fp16():
    shapes = {"a": (2,), "b": (3,)}
    out, _ = replan_states({"a": {"residual": np.ones(2, np.float16)}}, [(MODEL_KEY, ["a", "b"], "stc")], shapes)
    assert out[MODEL_KEY]["residual"].dtype == np.float32  # b had no piece: zeros, in float32
    np.testing.assert_array_equal(out[MODEL_KEY]["residual"], [1, 1, 0, 0, 0])
    out16, _ = replan_states({"a": {"residual": np.ones(2, np.float16)}, "b": {"residual": np.ones(3, np.float16)}},
                             [(MODEL_KEY, ["a", "b"], "stc")], shapes)
    assert out16[MODEL_KEY]["residual"].dtype == np.float16


def test_state_of_another_model_is_dropped_with_a_warning(caplog):
    shapes = {"a": (2,), "b": (3,)}
    states = {MODEL_KEY: {"residual": np.ones(7, np.float32)}}  # 7 entries: not this model's 5
    out, dropped = replan_states(states, [("a", ["a"], "sign"), ("b", ["b"], "sign")], shapes)
    assert dropped == [MODEL_KEY] and out == {}
    g = {"a": np.zeros(2, np.float32), "b": np.zeros(3, np.float32)}
    with caplog.at_level(logging.WARNING, logger="flwr"):
        _, new, _ = compress_update(g, {k: v + 1 for k, v in g.items()}, CodecConfig(compressor="sign"),
                                    {MODEL_KEY: np.ones(7, np.float32)})
    assert "does not fit the model's parameters" in caplog.text
    np.testing.assert_allclose(new["a"], 0.0, atol=1e-7)  # sign of an all-ones update is exact, nothing carried
