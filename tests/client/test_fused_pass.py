"""The fused client pass (update, residual add, finiteness and per-layer norms in one pass over each
tensor, :func:`fedcomp.compression.feedback_pass.write_delta` with ``add_residual``) gives bit for bit what the
classic path (``ErrorFeedback.compress`` on the update) gives: payload bytes, the new residual and
every statistic, over several rounds, for the models users run (BatchNorm, integer and bool buffers,
0-d parameters, fp16 and float64 weights) and the codecs and residual dtypes; and it refuses the same
inputs with the same errors."""

import numpy as np
import pytest

import fedcomp.compression.feedback_pass as feedback_pass
from fedcomp.client.plan import plan_update
from fedcomp.client.update import compress_update
from fedcomp.config import CodecConfig


def _model(rng, dtype=np.float32):
    """A small conv + BatchNorm + linear state_dict with an int64 counter, a bool mask and a 0-d
    parameter, in ``dtype``."""
    return {"conv.weight": rng.standard_normal((16, 3, 3, 3)).astype(dtype),
            "bn.weight": rng.standard_normal(16).astype(dtype), "bn.bias": rng.standard_normal(16).astype(dtype),
            "bn.running_mean": rng.standard_normal(16).astype(dtype), "bn.running_var": rng.random(16).astype(dtype),
            "bn.num_batches_tracked": np.array(5, np.int64), "temperature": np.array(0.5, dtype),
            "fc.weight": rng.standard_normal((10, 300)).astype(dtype), "mask": np.array([True, False, True]),
            "fc.bias": rng.standard_normal(10).astype(dtype)}


def _classic(monkeypatch):
    """Make compress_update take the classic path (no fused residual add) until undone."""
    monkeypatch.setattr(feedback_pass, "summable_residual", lambda unit, state, codec: (False, None))


def _errors_on_both_paths(monkeypatch, *calls):
    """The ValueError texts of each call in ``calls``, on the fused path and then on the classic one."""
    out = []
    for path in ("fused", "classic"):
        if path == "classic":
            _classic(monkeypatch)
        texts = []
        for call in calls:
            with pytest.raises(ValueError) as err:
                call()
            texts.append(str(err.value))
        out.append(tuple(texts))
    return out


def _rounds(codec, dtype, rounds=3, seed=0):
    rng = np.random.default_rng(seed)
    g = _model(rng, dtype)
    state, out = {}, []
    for rnd in range(rounds):
        t = {k: (v + (0.1 * rng.standard_normal(v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v)
             for k, v in g.items()}
        payloads, state, stats = compress_update(g, t, codec, state, seed=rnd)
        out.append((payloads, {k: (v.dtype, v.shape, v.tobytes()) for k, v in state.items()}, stats))
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("codec", [
    CodecConfig(compressor="stc", density=0.05),
    CodecConfig(compressor="topk", density=0.05, residual_dtype="fp16"),
    CodecConfig(compressor="sign"),
    CodecConfig(compressor="int8", min_compress_numel=1),
    CodecConfig(compressor="stc", density=0.05, density_schedule="adaptive"),
    CodecConfig(compressor="powersgd"),
], ids=["stc", "topk-fp16-residual", "sign", "int8-every-tensor", "stc-adaptive", "powersgd"])
def test_fused_pass_is_bit_identical_to_the_classic_path(codec, dtype, monkeypatch):
    fused = _rounds(codec, dtype)
    _classic(monkeypatch)
    classic = _rounds(codec, dtype)
    for (p1, s1, m1), (p2, s2, m2) in zip(fused, classic):
        assert p1 == p2  # the wire bytes
        assert s1 == s2  # the new residual (dtype, shape, bytes) and codec state
        assert m1 == m2  # every statistic, exactly (float32 reductions of the same slices)
    assert any(s for _, s, _ in fused)  # error feedback kept a residual


def _pair(rng):
    g = _model(rng)
    return g, {k: (v + np.float32(0.1) if v.dtype.kind == "f" else v) for k, v in g.items()}


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_update_is_refused_with_the_same_error_and_the_residual_kept(bad, monkeypatch):
    codec = CodecConfig(compressor="stc", density=0.05)
    g, t = _pair(np.random.default_rng(1))
    _, res, _ = compress_update(g, t, codec, {})
    before = {k: v.copy() for k, v in res.items()}
    t["fc.weight"][3, 7] = bad
    msgs = _errors_on_both_paths(monkeypatch, lambda: compress_update(g, t, codec, res))
    assert all(np.array_equal(before[k], res[k]) for k in res)
    assert msgs[0] == msgs[1] == ("update of 'fc.weight' holds non-finite values (NaN or Inf); refusing to compress",)


def test_a_non_finite_saved_residual_and_an_overflow_are_refused_as_before(monkeypatch):
    codec = CodecConfig(compressor="sign")
    g, t = _pair(np.random.default_rng(2))
    _, res, _ = compress_update(g, t, codec, {})
    poisoned = {k: v.copy() for k, v in res.items()}
    poisoned["fc.weight"][0, 0] = np.inf
    huge = {k: np.full_like(v, 3e38) for k, v in res.items()}
    t_huge = {k: (v + np.float32(3e38) if v.dtype.kind == "f" else v) for k, v in g.items()}
    out = _errors_on_both_paths(monkeypatch, lambda: compress_update(g, t, codec, poisoned),
                                lambda: compress_update(g, t_huge, codec, huge))
    assert out[0] == out[1] == ("state entry 'residual' is not a finite float array",
                                "input + residual overflows float32; residual left unchanged")


def test_a_float64_update_beyond_float32_is_refused_naming_the_tensor():
    rng = np.random.default_rng(3)
    g = _model(rng, np.float64)
    t = {k: (v + 1.0 if v.dtype.kind == "f" else v) for k, v in g.items()}
    t["conv.weight"][0, 0, 0, 0] = 1e300
    with pytest.raises(ValueError, match="float64 tensor 'conv.weight' reaches 1e\\+300, beyond the float32 range"):
        compress_update(g, t, CodecConfig(compressor="stc", density=0.05), {})


def test_the_fused_pass_needs_no_residual_and_skips_what_it_cannot_fuse():
    """Round 1 (no residual) is fused too; a residual of another dtype (saved under residual-dtype fp16,
    now fp32) or another shape, EF21 and DGC's momentum take the classic path."""
    codec = CodecConfig(compressor="stc", density=0.05)
    g, t = _pair(np.random.default_rng(4))
    units, _, _ = plan_update(g, t, codec, {k: str(v.dtype) for k, v in g.items()})
    big = units[-1]
    r32 = np.zeros(big.shape, np.float32)
    assert feedback_pass.summable_residual(big, {}, codec) == (True, None)
    assert feedback_pass.summable_residual(big, {"residual": r32}, codec)[1] is r32
    assert feedback_pass.summable_residual(big, {"residual": r32.astype(np.float16)}, codec) == (False, None)
    assert feedback_pass.summable_residual(big, {"residual": r32[:-1]}, codec) == (False, None)
    for other in (CodecConfig(compressor="stc", error_feedback="ef21"),
                  CodecConfig(compressor="topk", momentum_correction=0.9),
                  CodecConfig(compressor="stc", error_feedback=False)):
        assert feedback_pass.summable_residual(big, {}, other) == (False, None)


@pytest.mark.parametrize("name", ["stc", "topk", "sign", "int8", "qsgd", "eden", "randomk", "none", "fp16", "powersgd"])
def test_compress_finite_is_compress_without_the_finiteness_pass(name):
    import torch

    import fedcomp.compression as fc

    def codec():
        return fc.get_compressor(name, seed=3) if name in ("int8", "qsgd", "eden", "randomk", "powersgd") else \
            fc.get_compressor(name)

    x = torch.from_numpy(np.random.default_rng(5).standard_normal((64, 48)).astype(np.float32))
    assert codec().compress_finite(x) == codec().compress(x)
    wide = x.double()  # another dtype goes through compress (and its checks)
    assert codec().compress_finite(wide) == codec().compress(wide)
