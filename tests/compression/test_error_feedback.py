"""Error feedback: telescoping, state save/restore, fp16 residual, bad input keeps state."""

import numpy as np
import pytest
import torch

import fedcomp.compression as fc


def seq(n_steps=20, n=500, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for _ in range(n_steps)]


CONVERGENT = [n for n in fc.available_compressors() if not fc.get_compressor(n).error_feedback_refusal()]


@pytest.mark.parametrize("name", CONVERGENT)
def test_telescoping_identity(name):
    xs = seq()
    ef = fc.ErrorFeedback(fc.get_compressor(name, **({"seed": 0} if name in ("qsgd", "int8", "randomk") else {})))
    sent = torch.zeros(500, dtype=torch.float64)
    for x in xs:
        sent += fc.decompress(ef.compress(x)).double()
    total = torch.stack(xs).double().sum(0)
    assert torch.allclose(sent + ef.residual.double(), total, atol=1e-4)


def test_first_call_residual_is_compression_loss():
    x = torch.tensor([1.0, -4.0, 0.5, 2.0])
    ef = fc.ErrorFeedback(fc.get_compressor("topk", density=0.5))
    fc.decompress(ef.compress(x))
    assert ef.residual.tolist() == [1.0, 0.0, 0.5, 0.0]
    # second call: residual added before selection
    out = fc.decompress(ef.compress(torch.zeros(4)))
    assert out.tolist() == [1.0, 0.0, 0.5, 0.0]
    assert ef.residual.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_stats_of_last_call():
    ef = fc.ErrorFeedback(fc.get_compressor("topk", density=0.25))
    ef.compress(torch.tensor([3.0, 4.0, 0.0, 0.0]))
    assert ef.last_error == pytest.approx(0.6)
    assert ef.residual_norm == pytest.approx(3.0)


def test_save_and_restore_residual():
    xs = seq(5)
    a = fc.ErrorFeedback(fc.get_compressor("stc", density=0.05))
    for x in xs[:3]:
        a.compress(x)
    saved = a.get_residual()
    assert isinstance(saved, np.ndarray) and saved.dtype == np.float32
    b = fc.ErrorFeedback(fc.get_compressor("stc", density=0.05))
    b.set_residual(saved)
    assert a.compress(xs[3]) == b.compress(xs[3])


def test_fp16_residual_halves_memory_and_telescopes_to_fp16_precision():
    xs = seq(10)
    ef = fc.ErrorFeedback(fc.get_compressor("sign"), residual_dtype="fp16")
    sent = torch.zeros(500, dtype=torch.float64)
    for x in xs:
        sent += fc.decompress(ef.compress(x)).double()
    assert ef.residual.dtype == torch.float16
    assert ef.residual.element_size() == 2
    total = torch.stack(xs).double().sum(0)
    assert torch.allclose(sent + ef.residual.double(), total, atol=10 * 2**-10 * float(total.abs().max()))


def test_nan_input_leaves_residual_unchanged():
    ef = fc.ErrorFeedback(fc.get_compressor("sign"))
    ef.compress(torch.ones(4))
    before = ef.residual.clone()
    with pytest.raises(ValueError, match="non-finite"):
        ef.compress(torch.tensor([1.0, float("nan"), 0.0, 0.0]))
    assert torch.equal(ef.residual, before)


def test_shape_change_rejected():
    ef = fc.ErrorFeedback(fc.get_compressor("sign"))
    ef.compress(torch.ones(4))
    with pytest.raises(ValueError, match="differs"):
        ef.compress(torch.ones(5))
    ef.reset()
    assert len(ef.compress(torch.ones(5))) > 0


def test_bad_constructor_arguments():
    with pytest.raises(TypeError):
        fc.ErrorFeedback("sign")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="residual_dtype"):
        fc.ErrorFeedback(fc.get_compressor("sign"), residual_dtype="int8")
    with pytest.raises(ValueError, match="non-finite"):
        fc.ErrorFeedback(fc.get_compressor("sign")).set_residual(np.array([np.inf], dtype=np.float32))


def test_fp16_residual_saturation_is_counted_with_what_it_loses():
    # an fp16 residual clamps at 65504: what the clamp loses is counted, never lost silently
    x = torch.full((100,), 2e4)
    e = torch.zeros(100)
    e[:50] = 6e4  # exact in fp16
    e[0] = 6.5e4  # x + e = 8.5e4 there: the one entry top-k (k = 1) sends
    ef = fc.ErrorFeedback(fc.get_compressor("topk", density=0.01), residual_dtype="fp16")
    ef.set_residual(e)
    ef.compress(x)
    assert ef.last_saturated == 49  # entries 1..49 hold 8e4 > 65504
    v1 = (2e4 + 64992) ** 2 + 49 * 8e4**2 + 50 * 2e4**2  # ||x + e||^2; 6.5e4 is stored as 64992 in fp16
    assert ef.last_saturated_loss == pytest.approx((49 * (8e4 - 65504) ** 2 / v1) ** 0.5, rel=1e-6)
    assert float(ef.residual[1]) == 65504.0
    ef.compress(torch.zeros(100))  # nothing new above the ceiling: 0 again (per call, not cumulative)
    assert (ef.last_saturated, ef.last_saturated_loss) == (0, 0.0)
    fp32 = fc.ErrorFeedback(fc.get_compressor("topk", density=0.01))
    fp32.set_residual(e)
    fp32.compress(x)
    assert (fp32.last_saturated, fp32.last_saturated_loss) == (0, 0.0)


def test_fp16_residual_saturates_instead_of_becoming_inf():
    ef = fc.ErrorFeedback(fc.get_compressor("topk", density=0.1), residual_dtype="fp16")
    ef.compress(torch.full((10,), 1e6))
    assert bool(torch.isfinite(ef.residual).all()) and float(ef.residual.max()) == 65504.0
    ef.compress(torch.zeros(10))  # the next round still works


def test_feedback_pass_is_error_feedback_on_the_update():
    """The one entry point, on trained and received weights, sends what ErrorFeedback.compress sends on
    their difference and keeps the same residual, round after round (the fused residual add)."""
    from fedcomp.compression.feedback_pass import Unit, feedback_pass

    class Settings:
        error_feedback, residual_dtype, momentum_correction = True, "fp32", 0.0

    rng = np.random.default_rng(0)
    unit = Unit("w", ["w"], "topk", [600], (20, 30), False)
    ef, state = fc.ErrorFeedback(fc.get_compressor("topk", density=0.1)), {}
    for _ in range(3):
        g = {"w": rng.standard_normal((20, 30)).astype(np.float32)}
        t = {"w": g["w"] + rng.standard_normal((20, 30)).astype(np.float32)}
        out = feedback_pass(unit, state, lambda d: fc.get_compressor("topk", density=0.1), Settings,
                            pair=(t, g, {"w": "float32"}))
        assert out.payload == ef.compress(torch.from_numpy(t["w"] - g["w"]))
        assert np.array_equal(out.state["residual"], ef.get_residual())
        state = out.state


def _strided_inputs(kind, n_steps=4, seed=0):
    """Non-contiguous float32 updates: a transposed weight or a channels_last conv weight."""
    g = torch.Generator().manual_seed(seed)
    if kind == "transposed":
        return [torch.randn(24, 40, generator=g).t() for _ in range(n_steps)]
    return [torch.randn(6, 5, 4, 4, generator=g).to(memory_format=torch.channels_last) for _ in range(n_steps)]


@pytest.mark.parametrize("kind", ["transposed", "channels_last"])
@pytest.mark.parametrize("memory", ["error-feedback", "momentum", "ef21"])
@pytest.mark.parametrize("name", CONVERGENT)
def test_telescoping_identity_for_strided_inputs(name, memory, kind):
    """sum(decoded sends) + residual == sum(inputs) for non-contiguous inputs too, with every codec and
    memory; the same payloads and residual as for the inputs' contiguous copies."""
    from fedcomp.compression.registry import codecs_with

    def build():
        c = fc.get_compressor(name, **({"seed": 0} if name in codecs_with(seeded=True) else {}))
        if memory == "ef21":
            return fc.EF21(c)
        return fc.ErrorFeedback(c, momentum=0.5 if memory == "momentum" else 0.0)

    xs = _strided_inputs(kind)
    assert not xs[0].is_contiguous()
    ef, ref = build(), build()
    sent = torch.zeros(xs[0].shape, dtype=torch.float64)
    for x in xs:
        payload = ef.compress(x)
        assert payload == ref.compress(x.contiguous())
        sent += fc.decompress(payload).double()
    assert torch.equal(ef.residual, ref.residual)
    if memory == "error-feedback":
        total = torch.stack(xs).double().sum(0)
        assert float((sent + ef.residual.double() - total).abs().max()) < 1e-4
    elif memory == "ef21":  # the estimate h is what the receiver has decoded
        assert float((sent - ef.residual.double()).abs().max()) < 1e-4


@pytest.mark.parametrize("name", ["stc", "topk", "randomk", "sign", "int8"])
def test_encode_and_subtract_writes_the_error_into_a_strided_tensor(name):
    from fedcomp.compression.error_feedback import encode_and_subtract

    c = fc.get_compressor(name, **({"seed": 0} if name in ("randomk", "int8") else {}))
    x = torch.randn(30, 20, generator=torch.Generator().manual_seed(1)).t()
    v = x.clone()  # keeps the transposed strides
    assert not v.is_contiguous()
    payload, _, errors, _ = encode_and_subtract(c, v)
    assert torch.equal(v, x - fc.decompress(payload))
    assert errors[0] == pytest.approx(float(torch.linalg.vector_norm(v)) ** 2, rel=1e-6)


# -- codecs with which error feedback diverges are refused ---------------------------------------------


@pytest.mark.parametrize("opts, bound", [({"levels": 15}, 512 / 900), ({"levels": 12}, 512 / 576),
                                         ({"levels": 3, "bucket_size": 8}, 8 / 36),
                                         ({"levels": 7, "spacing": "exponential"}, 0.125 + 2 * 512 * 4.0**-6 / 9)])
def test_qsgd_with_enough_levels_keeps_a_bounded_residual(opts, bound):
    codec = fc.get_compressor("qsgd", seed=1, **opts)
    assert codec.variance_bound() == pytest.approx(bound) and codec.error_feedback_refusal() == ""
    ef = fc.ErrorFeedback(codec)
    gen = torch.Generator().manual_seed(0)
    ratios = []
    for _ in range(40):
        x = torch.randn(8192, generator=gen)
        ef.compress(x)
        ratios.append(float(ef.residual.norm() / x.norm()))
    assert max(ratios[20:]) < 2.0  # steady, not growing


@pytest.mark.parametrize("opts, fewest", [({"levels": 11}, "12"), ({"levels": 1}, "12"),
                                          ({"levels": 4, "spacing": "exponential"}, "5")])
def test_qsgd_with_too_few_levels_is_refused_under_error_feedback(opts, fewest):
    # unrefused, the residual grew without bound: levels=1 over 512-entry buckets multiplied it by ~4 a step
    codec = fc.get_compressor("qsgd", seed=1, **opts)
    assert codec.variance_bound() >= 1.0
    with pytest.raises(ValueError, match=f"levels' to {fewest} or more.*turn error feedback off"):
        fc.ErrorFeedback(codec)
    codec.compress(torch.randn(1000))  # without error feedback the codec works as before


def _exact_variance(r: np.ndarray, levels: np.ndarray) -> float:
    """E||x_hat - x||^2 / ||x||^2 of one bucket whose normalised magnitudes are r (stochastic rounding between the
    two adjacent levels)."""
    hi = levels[np.searchsorted(levels, r, side="left").clip(1, len(levels) - 1)]
    lo = levels[np.searchsorted(levels, r, side="left").clip(1, len(levels) - 1) - 1]
    return float(((hi - r) * (r - lo)).sum())


@pytest.mark.parametrize("levels, spacing, d", [(2, "uniform", 15), (2, "exponential", 15), (5, "exponential", 1000),
                                                (3, "exponential", 48), (1, "exponential", 3), (4, "uniform", 64)])
def test_the_variance_bound_holds_on_the_worst_buckets_it_names(levels, spacing, d):
    from fedcomp.compression.qsgd import exponential_levels

    codec = fc.get_compressor("qsgd", levels=levels, bucket_size=d, spacing=spacing)
    grid = exponential_levels(levels).astype(np.float64) if spacing == "exponential" else np.arange(levels + 1) / levels
    rng = np.random.default_rng(0)
    worst = 0.0
    for scale in np.geomspace(1e-3, 1.0, 60):  # d - 1 equal small entries and one that makes the norm 1
        small = np.full(d - 1, scale / np.sqrt(d))
        big = np.sqrt(max(1.0 - (small**2).sum(), 0.0))
        worst = max(worst, _exact_variance(np.append(small, big), grid))
    for _ in range(200):
        r = np.abs(rng.standard_normal(d)) * rng.random(d) ** 3
        worst = max(worst, _exact_variance(r / np.linalg.norm(r), grid))
    assert worst <= codec.variance_bound() + 1e-12
    assert (codec.error_feedback_refusal() == "") == (codec.variance_bound() < 1)


def test_rescaled_randomk_is_refused_under_error_feedback():
    # unrefused, its residual grew from 11 to 96,000 in 11 steps of a 2-rank DDP run (density 0.05)
    with pytest.raises(ValueError, match="randomk with rescale=True at density=0.05.*19 x"):
        fc.ErrorFeedback(fc.get_compressor("randomk", density=0.05, rescale=True, seed=0))
    assert fc.get_compressor("randomk", density=0.6, rescale=True).error_feedback_refusal() == ""
    assert fc.get_compressor("randomk", density=0.05).error_feedback_refusal() == ""


def test_atomo_is_refused_under_error_feedback():
    # unrefused, on random 128 x 256 matrices the residual grew from 5 to 100,000 times the input's norm in 32 steps
    with pytest.raises(ValueError, match="atomo .* turn error feedback off"):
        fc.ErrorFeedback(fc.get_compressor("atomo", atoms=2, seed=0))


def test_every_biased_codec_is_accepted_under_error_feedback():
    for name in fc.CODECS:
        if name not in ("qsgd", "atomo"):
            assert fc.get_compressor(name).error_feedback_refusal() == "", name
