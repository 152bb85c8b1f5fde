"""Client codec state beyond the residual: DGC momentum correction (reference check against
Lin et al. 2018's algorithm), PowerSGD's warm-start Q, get_state/set_state and their flat form."""

import numpy as np
import pytest
import torch

import fedcomp.compression as fc
from fedcomp.compression.error_feedback import flatten_states, unflatten_states


def seq(n_steps=15, n=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for _ in range(n_steps)]


def dgc_reference(xs, beta, k):
    """Deep Gradient Compression, Algorithm 1 with momentum correction and factor masking, on one
    worker: u <- beta u + g; v <- v + u; send top-k of v; u, v <- 0 where sent."""
    u = torch.zeros_like(xs[0])
    v = torch.zeros_like(xs[0])
    sends = []
    for g in xs:
        u = beta * u + g
        v = v + u
        idx = torch.topk(v.abs(), k).indices
        sent = torch.zeros_like(v)
        sent[idx] = v[idx]
        v[idx] = 0
        u[idx] = 0
        sends.append(sent)
    return sends, u, v


def test_momentum_correction_equals_dgc_for_topk():
    xs = seq()
    ef = fc.ErrorFeedback(fc.get_compressor("topk", density=0.05), momentum=0.9)
    sends, u, v = dgc_reference(xs, 0.9, 20)
    for x, ref in zip(xs, sends):  # equal to fp32 rounding (beta * u + x may be one fused multiply-add)
        torch.testing.assert_close(fc.decompress(ef.compress(x)), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ef.momentum_buffer, u, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ef.residual, v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["stc", "randomk", "topk"])
def test_momentum_telescoping(name):
    xs = seq()
    params = {"density": 0.05} | ({"seed": 0} if name == "randomk" else {})
    ef = fc.ErrorFeedback(fc.get_compressor(name, **params), momentum=0.5)
    sent = torch.zeros(400, dtype=torch.float64)
    pushed = torch.zeros(400, dtype=torch.float64)
    for x in xs:
        u_pre = x.double() if ef.momentum_buffer is None else 0.5 * ef.momentum_buffer.double() + x.double()
        pushed += u_pre
        out = fc.decompress(ef.compress(x))
        sent += out.double()
        assert bool((ef.momentum_buffer[out != 0] == 0).all())  # masked where sent
    assert torch.allclose(sent + ef.residual.double(), pushed, atol=1e-4)


def test_momentum_with_a_dense_codec_is_plain_error_feedback():
    xs = seq(5)
    a = fc.ErrorFeedback(fc.get_compressor("sign"), momentum=0.9)
    b = fc.ErrorFeedback(fc.get_compressor("sign"))
    for x in xs:
        assert a.compress(x) == b.compress(x)


def test_bad_momentum():
    for beta in (-0.1, 1.0, float("nan"), True):
        with pytest.raises(ValueError, match="momentum"):
            fc.ErrorFeedback(fc.get_compressor("topk"), momentum=beta)


@pytest.mark.parametrize("name,params,shape", [
    ("topk", {"density": 0.1}, (400,)), ("powersgd", {"rank": 2, "seed": 0}, (40, 10)),
    ("stc", {"density": 0.1}, (8, 50)),
])
def test_state_round_trip_continues_identically(name, params, shape):
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(*shape, generator=g) for _ in range(6)]
    a = fc.ErrorFeedback(fc.get_compressor(name, **params), momentum=0.9 if name != "powersgd" else 0.0)
    for x in xs[:3]:
        a.compress(x)
    state = a.get_state()
    assert all(isinstance(v, np.ndarray) and v.dtype == np.float32 for v in state.values())
    expected = {"residual"} | ({"powersgd/q"} if name == "powersgd" else {"momentum"})
    assert set(state) == expected
    # through the flat form the mod persists (ArrayRecord / npz), for two payload keys
    flat = flatten_states({"conv.weight": state, "model": {"residual": state["residual"]}})
    assert "conv.weight" in flat and all(k.startswith(("conv.weight", "model")) for k in flat)
    back = unflatten_states(flat)
    b = fc.ErrorFeedback(fc.get_compressor(name, **{**params, "seed": 99} if name == "powersgd" else params),
                         momentum=a.momentum)
    assert b.set_state(back["conv.weight"], shape=shape) == []
    for x in xs[3:]:
        assert a.compress(x) == b.compress(x)


def test_flat_form_keeps_old_residual_files_readable():
    flat = {"fc.weight": np.zeros(3, np.float32), "odd#name": np.ones(2, np.float32),
            "fc.weight#momentum": np.ones(3, np.float32), "w#powersgd/q": np.ones((2, 1), np.float32)}
    back = unflatten_states(flat)
    assert set(back) == {"fc.weight", "odd#name", "w"}
    assert set(back["fc.weight"]) == {"residual", "momentum"} and set(back["odd#name"]) == {"residual"}
    assert set(back["w"]) == {"powersgd/q"}
    assert flatten_states(back).keys() == flat.keys()


def test_set_state_drops_entries_of_another_shape_and_rejects_non_finite():
    ef = fc.ErrorFeedback(fc.get_compressor("topk", density=0.1), momentum=0.9)
    dropped = ef.set_state({"residual": np.ones(5, np.float32), "momentum": np.ones(4, np.float32)}, shape=(4,))
    assert dropped == ["residual"] and ef.residual is None and tuple(ef.momentum_buffer.shape) == (4,)
    ef.compress(torch.ones(4))
    before = ef.get_state()
    with pytest.raises(ValueError, match="finite"):
        ef.set_state({"residual": np.array([np.nan, 0, 0, 0], np.float32)})
    with pytest.raises(ValueError, match="finite"):
        ef.set_state({"momentum": np.array([1, 2, 3, 4], np.int64)})
    after = ef.get_state()
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_momentum_shape_change_is_refused_and_state_kept():
    ef = fc.ErrorFeedback(fc.get_compressor("topk", density=0.5), momentum=0.9)
    ef.compress(torch.ones(4))
    with pytest.raises(ValueError, match="differs from the residual's"):
        ef.compress(torch.ones(5))
    assert tuple(ef.momentum_buffer.shape) == (4,)
    ef.set_state({"momentum": np.ones(5, np.float32)})
    with pytest.raises(ValueError, match="momentum buffer"):
        ef.compress(torch.ones(4))
    assert tuple(ef.momentum_buffer.shape) == (5,)
    ef.reset()
    assert ef.get_state() == {}


def test_fp16_state_storage():
    ef = fc.ErrorFeedback(fc.get_compressor("topk", density=0.1), residual_dtype="fp16", momentum=0.9)
    ef.compress(torch.full((100,), 1e5) * torch.linspace(0.1, 1.0, 100))
    st = ef.get_state()
    assert st["residual"].dtype == np.float16 and st["momentum"].dtype == np.float16
    assert np.isfinite(st["momentum"]).all()
