"""The standalone decoding API and the codecs' numerics."""

import struct
import tracemalloc

import numpy as np
import pytest
import torch

import fedcomp.compression as fc
from fedcomp.compression.powersgd import orthogonalize
from fedcomp.compression.randomk import random_mask, random_positions
from fedcomp.compression.wire import EXACT_DTYPE_CODES, parse_header


def _with_dtype_code(payload: bytes, code: int) -> bytes:
    """The payload with its header's dtype byte (offset 6) replaced."""
    b = bytearray(payload)
    b[6] = code
    return bytes(b)


# -- Decompress_sparse raises as decompress does -------------------------------------

def test_decompress_sparse_refuses_an_unknown_codec_id():
    p = bytearray(fc.get_compressor("topk", density=0.5).compress(torch.arange(8.0)))
    p[5] = 200  # codec id byte
    with pytest.raises(fc.PayloadError, match="unknown codec id 200"):
        fc.decompress_sparse(bytes(p))
    with pytest.raises(fc.PayloadError, match="unknown codec id 200"):
        fc.decompress(bytes(p))


def test_decompress_sparse_refuses_an_exact_payload():
    p = fc.encode_exact(np.arange(6, dtype=np.int64))
    with pytest.raises(fc.PayloadError, match="decode_exact"):
        fc.decompress_sparse(p)


def test_decompress_sparse_still_answers_none_for_a_dense_codec():
    assert fc.decompress_sparse(fc.get_compressor("sign").compress(torch.ones(4))) is None


# -- The header's dtype is validated against the codec -------------------------------

@pytest.mark.parametrize("name", ["sign", "topk", "int8", "none"])
@pytest.mark.parametrize("dt", [np.int64, np.uint8, np.bool_])
def test_a_float_codec_header_that_declares_an_integer_dtype_is_refused(name, dt):
    p = _with_dtype_code(fc.get_compressor(name).compress(torch.linspace(-1, 1, 16)), EXACT_DTYPE_CODES[np.dtype(dt)])
    with pytest.raises(fc.PayloadError, match=f"{name} payload declares dtype {np.dtype(dt)}"):
        fc.decompress(p)
    with pytest.raises(fc.PayloadError, match="declares dtype"):
        fc.decompress_sparse(p)


# -- Randomk's sparse decode is O(k) ---------------------------------------------------

def test_randomk_sparse_decode_of_one_entry_in_2_pow_24_allocates_o_k():
    n = 2**24
    p = fc.get_compressor("randomk", density=1 / n, seed=3).compress(torch.zeros(0).new_full((n,), 0.5))
    assert len(p) < 64
    tracemalloc.start()
    try:
        pos, vals = fc.decompress_sparse(p, max_numel=n)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert pos.shape == (1,) and 0 <= int(pos[0]) < n and vals.tolist() == [0.5]
    assert peak < 64 * 1024  # was 16 MiB (the n-byte mask)


@pytest.mark.parametrize("n,k", [(64, 1), (1000, 3), (2**16, 1000), (2**20, 2**14), (10**6, 15625),
                                 (2**20, 2**18), (100, 99)])
def test_randomk_positions_equal_the_mask_selection(n, k):
    for seed in (0, 1, 2**62 + 5):
        assert np.array_equal(random_positions(seed, n, k), np.flatnonzero(random_mask(seed, n, k)))


def test_randomk_sparse_and_dense_decodes_agree():
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(1))
    p = fc.get_compressor("randomk", density=0.001, rescale=True, seed=9).compress(x)
    pos, vals = fc.decompress_sparse(p)
    dense = fc.decompress(p).numpy()
    assert pos.size == 50 and np.array_equal(np.flatnonzero(dense), pos)
    np.testing.assert_array_equal(dense[pos], vals)
    np.testing.assert_array_equal(vals, x.numpy()[pos] * np.float32(1000.0))


# -- The sign scale is mean |x| at model size ------------------------------------------

def test_sign_scale_is_mean_abs_within_1e_6_at_4m_entries():
    x = torch.randn(2**22, generator=torch.Generator().manual_seed(0))
    (scale,) = struct.unpack("<f", parse_header(fc.get_compressor("sign").compress(x), 2**22).params)
    true = float(x.double().abs().mean())
    assert abs(scale - true) / true < 1e-6  # the fp32 ord-1 norm / n was off by 3.1e-4


# -- PowerSGD on rank-deficient matrices -----------------------------------------------

def _rank_d(m: int, n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if d == 0:
        return torch.zeros(m, n)
    return torch.randn(m, d, generator=g) @ torch.randn(d, n, generator=g)


def test_rank_1_300x200_at_rank_2_is_recovered():
    m = _rank_d(300, 200, 1, 0)
    out = fc.decompress(fc.get_compressor("powersgd", rank=2, seed=0).compress(m))
    assert fc.compression_error(m, out) < 1e-5  # was 0.61


@pytest.mark.parametrize("d", [0, 1, 2, 3, 5])
@pytest.mark.parametrize("rank", [1, 2, 3, 4, 6, 8])
def test_rank_deficient_inputs_at_every_rank(d, rank):
    m = _rank_d(60, 40, d, seed=10 * d + rank)
    c = fc.get_compressor("powersgd", rank=rank, seed=rank)
    for _ in range(3):  # first round from a random Q, then warm starts
        out = fc.decompress(c.compress(m))
        err = fc.compression_error(m, out)
        if rank >= d:
            assert err < 1e-5, (d, rank, err)
        else:  # P P^T M is a projection of M: never worse than sending nothing
            assert err <= 1.0 + 1e-5, (d, rank, err)


def test_one_example_linear_gradient_is_rank_1_and_recovered_at_rank_4():
    g = torch.Generator().manual_seed(4)
    grad = torch.outer(torch.randn(128, generator=g), torch.randn(64, generator=g))  # dL/dW = delta x^T
    ef = fc.ErrorFeedback(fc.get_compressor("powersgd", rank=4, seed=1))
    out = fc.decompress(ef.compress(grad))
    assert fc.compression_error(grad, out) < 1e-5
    assert float(ef.residual.norm() / grad.norm()) < 1e-5


@pytest.mark.parametrize("p", [torch.zeros(20, 3),
                               torch.ones(20, 3),
                               torch.cat([torch.arange(20.0)[:, None]] * 4, dim=1)])
def test_orthogonalize_gives_orthonormal_columns_for_dependent_columns(p):
    out = orthogonalize(p)
    assert out is p and bool(torch.isfinite(p).all())
    torch.testing.assert_close(p.T @ p, torch.eye(p.shape[1]), atol=1e-5, rtol=0)
