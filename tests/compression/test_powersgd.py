"""PowerSGD: Algorithm 1 reference check, warm start, error feedback, exact sizes, hostile payloads."""

import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fedcomp.compression as fc
from fedcomp.compression.powersgd import low_rank_pays, matrix_shape, orthogonalize
from fedcomp.compression.wire import pack_header, parse_header

from .helpers import decode_peak_ratio, decodes_or_payload_error, flip_and_cut


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def factors(payload: bytes, r: int, dtype=np.float32):
    """P (m x r) and Q (n x r) as they travel."""
    h = parse_header(payload)
    m, n = matrix_shape(h.shape)
    body = np.frombuffer(payload[h.body_offset:], dtype=dtype)
    return body[: m * r].reshape(m, r), body[m * r:].reshape(n, r)


def algorithm1(m: np.ndarray, q: np.ndarray):
    """Vogels et al. 2019, Algorithm 1 for one worker, in float64: P = M Q; P_hat = Gram-Schmidt(P);
    Q = M^T P_hat; decoded = P_hat Q^T."""
    p = m @ q
    p_hat = np.zeros_like(p)
    for i in range(p.shape[1]):
        col = p[:, i] - p_hat[:, :i] @ (p_hat[:, :i].T @ p[:, i])
        p_hat[:, i] = col / np.linalg.norm(col)
    q_new = m.T @ p_hat
    return p_hat, q_new, p_hat @ q_new.T


def test_registered_and_matrix_view():
    assert "powersgd" in fc.available_compressors()
    assert matrix_shape((64, 3, 3, 3)) == (64, 27)
    assert matrix_shape((5,)) is None and matrix_shape(()) is None


def test_p_and_q_equal_algorithm_1():
    m = randn(40, 30, seed=1)
    q0 = randn(30, 4, seed=2)
    c = fc.get_compressor("powersgd", rank=4)
    c.set_state({"q": q0.numpy()})
    payload = c.compress(m)
    p, q = factors(payload, 4)
    p_ref, q_ref, dec_ref = algorithm1(m.double().numpy(), q0.double().numpy())
    np.testing.assert_allclose(p, p_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(q, q_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(fc.decompress(payload).numpy(), dec_ref, rtol=1e-4, atol=1e-4)
    # P is orthonormal, and the warm-start Q kept on the codec is the Q that was sent
    np.testing.assert_allclose(p.T @ p, np.eye(4), atol=1e-5)
    assert np.array_equal(c.get_state()["q"], q)


def test_warm_start_uses_previous_q():
    c = fc.get_compressor("powersgd", rank=3, seed=0)
    m1, m2 = randn(20, 12, seed=3), randn(20, 12, seed=4)
    _, q1 = factors(c.compress(m1), 3)
    p2, q2 = factors(c.compress(m2), 3)
    p_ref, q_ref, _ = algorithm1(m2.double().numpy(), q1.astype(np.float64))
    np.testing.assert_allclose(p2, p_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(q2, q_ref, rtol=1e-4, atol=1e-4)


def test_first_q_is_a_seeded_normal_draw():
    m = randn(30, 20)
    a = fc.get_compressor("powersgd", rank=2, seed=7).compress(m)
    b = fc.get_compressor("powersgd", rank=2, seed=7).compress(m)
    c = fc.get_compressor("powersgd", rank=2, seed=8).compress(m)
    assert a == b and a != c
    q0 = torch.randn(20, 2, generator=torch.Generator().manual_seed(7))
    p_ref, _, _ = algorithm1(m.double().numpy(), q0.double().numpy())
    np.testing.assert_allclose(factors(a, 2)[0], p_ref, rtol=1e-4, atol=1e-5)


def test_exact_low_rank_matrix_is_recovered_in_one_round():
    m = randn(30, 2, seed=5) @ randn(2, 25, seed=6)
    out = fc.decompress(fc.get_compressor("powersgd", rank=2, seed=0).compress(m))
    assert fc.compression_error(m, out) < 1e-5


@pytest.mark.parametrize("m", [torch.zeros(16, 12), torch.outer(torch.arange(16.0), torch.ones(12)),
                               torch.zeros(16, 12).index_fill_(0, torch.tensor([3]), 1e-30)])
def test_zero_and_rank_deficient_updates_decode_finite(m):
    c = fc.get_compressor("powersgd", rank=4, seed=0)
    for _ in range(3):  # warm start from a zero Q as well
        out = fc.decompress(c.compress(m))
        assert bool(torch.isfinite(out).all())
        assert fc.compression_error(m, out) < 1e-5


def test_error_feedback_converges_to_the_sum_of_inputs():
    m = randn(20, 16, seed=9)
    ef = fc.ErrorFeedback(fc.get_compressor("powersgd", rank=4, seed=0))
    sent = torch.zeros(20, 16, dtype=torch.float64)
    res = {}
    for t in range(1, 201):
        sent += fc.decompress(ef.compress(m)).double()
        if t in (100, 200):
            res[t] = float(ef.residual.norm() / m.norm())
            # telescoping: decoded sends + residual == inputs
            assert torch.allclose(sent + ef.residual.double(), t * m.double(), atol=1e-3)
    assert res[100] < 3.0 and res[200] < 3.0  # the residual stays bounded ...
    assert float((200 * m.double() - sent).norm() / (200 * m.norm())) < 0.02  # ... so the mean send -> M


@pytest.mark.parametrize("shape,rank", [((64, 576), 4), ((64, 3, 3, 3), 4), ((100, 7), 2), ((7, 100), 2)])
@pytest.mark.parametrize("value_dtype,size", [("fp32", 4), ("fp16", 2)])
def test_size_is_exactly_r_times_m_plus_n(shape, rank, value_dtype, size):
    x = randn(*shape)
    c = fc.get_compressor("powersgd", rank=rank, value_dtype=value_dtype, seed=0)
    p = c.compress(x)
    m, n = matrix_shape(shape)
    r = min(rank, m, n)
    assert fc.codec_name(p) == "powersgd"
    assert len(p) == 10 + 8 * len(shape) + 5 + r * (m + n) * size
    assert fc.decompress(p).shape == x.shape


@pytest.mark.parametrize("shape", [(), (1,), (500,), (3, 3), (0, 5), (4, 4), (2, 2, 2)])
@pytest.mark.parametrize("fallback", ["none", "fp16"])
def test_where_low_rank_does_not_pay_the_small_tensor_codec_is_used(shape, fallback):
    x = randn(*shape) if shape else torch.tensor(2.5)
    c = fc.get_compressor("powersgd", rank=4, fallback=fallback)
    p = c.compress(x)
    assert fc.codec_name(p) == fallback
    assert c.get_state() == {}
    assert torch.equal(fc.decompress(p), x.to(getattr(torch, "float16" if fallback == "fp16" else "float32")).float())


def test_low_rank_pays_rule():
    assert not low_rank_pays(8, 8, 4, 2.0)  # 4 * 16 = 64 >= 64 / 2
    assert low_rank_pays(9, 9, 2, 2.0)  # 36 < 40.5
    assert not low_rank_pays(9, 9, 2, 3.0)  # 36 >= 27
    assert not low_rank_pays(0, 5, 4, 2.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_low_precision_inputs(dtype):
    x = randn(32, 24).to(dtype)
    p = fc.get_compressor("powersgd", rank=2, seed=0).compress(x)
    assert parse_header(p).dtype == dtype
    assert fc.decompress(p).dtype == torch.float32


def test_bad_parameters():
    for kw in ({"rank": 0}, {"rank": 1.5}, {"value_dtype": "int8"}, {"fallback": "stc"},
               {"min_compression_rate": 0.5}, {"seed": -1}):
        with pytest.raises(ValueError):
            fc.get_compressor("powersgd", **kw)
    with pytest.raises(ValueError, match="non-finite"):
        fc.get_compressor("powersgd").compress(torch.full((10, 10), float("nan")))
    with pytest.raises(ValueError, match="finite 2-D"):
        fc.get_compressor("powersgd").set_state({"q": np.full((3, 2), np.inf, dtype=np.float32)})


def test_saved_q_of_another_shape_is_redrawn():
    m = randn(30, 20)
    c = fc.get_compressor("powersgd", rank=2, seed=7)
    c.set_state({"q": np.ones((5, 2), dtype=np.float32)})
    assert c.compress(m) == fc.get_compressor("powersgd", rank=2, seed=7).compress(m)


def good(shape=(30, 20), rank=3, value_dtype="fp32"):
    return fc.get_compressor("powersgd", rank=rank, value_dtype=value_dtype, seed=0).compress(randn(*shape))


def test_every_truncation_and_trailing_bytes_rejected():
    p = good((12, 9), 2)
    for cut in range(len(p)):
        with pytest.raises(fc.PayloadError):
            fc.decompress(p[:cut])
    with pytest.raises(fc.PayloadError, match="trailing"):
        fc.decompress(p + b"\x00")


def _repack(p: bytes, shape=None, rank=None, code=None) -> bytes:
    h = parse_header(p)
    r0, c0 = struct.unpack("<IB", h.params)
    params = struct.pack("<IB", r0 if rank is None else rank, c0 if code is None else code)
    return pack_header(9, torch.float32, h.shape if shape is None else shape, params) + p[h.body_offset:]


@pytest.mark.parametrize("patch,msg", [
    ({"shape": (600,)}, "not a matrix"), ({"shape": ()}, "not a matrix"), ({"rank": 0}, "rank 0"),
    ({"rank": 21}, "rank 21"), ({"code": 7}, "dtype code"), ({"rank": 2}, "trailing"),
    ({"rank": 4}, "truncated"), ({"shape": (25, 20)}, "trailing"), ({"shape": (35, 20)}, "truncated"),
])
def test_inconsistent_header(patch, msg):
    with pytest.raises(fc.PayloadError, match=msg):
        fc.decompress(_repack(good(), **patch))


def test_non_finite_factors_and_overflowing_product_rejected():
    p = bytearray(good())
    p[-4:] = struct.pack("<f", float("nan"))
    with pytest.raises(fc.PayloadError, match="non-finite"):
        fc.decompress(bytes(p))
    h = parse_header(good())
    big = np.full(3 * 50, 3e38, dtype=np.float32).tobytes()
    with pytest.raises(fc.PayloadError, match="non-finite"):
        fc.decompress(pack_header(9, torch.float32, (30, 20), h.params) + big)


VALID = [good(), good((12, 9), 2, "fp16"), good((8, 2, 3, 3), 1)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(VALID), st.data())
def test_fuzz_bitflips_and_truncations(p, data):
    decodes_or_payload_error(flip_and_cut(p, data))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=0, max_size=3), st.binary(max_size=8), st.binary(max_size=600))
def test_fuzz_random_headers_and_bodies(shape, params, body):
    decodes_or_payload_error(pack_header(9, torch.float32, tuple(shape), params) + body)


def test_decode_peak_memory_at_one_million_entries():
    p = fc.get_compressor("powersgd", rank=4, seed=0).compress(randn(1000, 1000))
    assert decode_peak_ratio(p, 10**6) <= 4.0


def test_orthogonalize_is_in_place_and_orthonormal():
    p = randn(50, 5)
    out = orthogonalize(p)
    assert out is p
    torch.testing.assert_close(p.T @ p, torch.eye(5), atol=1e-5, rtol=0)


def test_the_decoded_product_does_not_depend_on_the_summation_order():
    """A low-rank decode gives the same bits whatever order the BLAS sums the rank in (a node's copy of a
    compressed download is compared bit for bit with the server's record, across CPU types): the product
    of the factors summed in the opposite order rounds to the same float32 matrix."""
    import numpy as np

    from fedcomp.compression.powersgd import exact_product

    rng = np.random.default_rng(3)
    a = rng.standard_normal((257, 4)).astype(np.float32) * np.float32(1e3)
    b = rng.standard_normal((4, 129)).astype(np.float32) * np.float32(1e-3)
    got = exact_product(a, b)
    assert got.dtype == np.float32 and got.shape == (257, 129)
    assert np.array_equal(got, exact_product(a[:, ::-1].copy(), b[::-1].copy()))
    assert np.array_equal(got, (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32))
