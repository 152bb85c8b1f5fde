"""eden (DRIVE/EDEN rotated 1-bit): reference check with an explicit Hadamard matrix, scales,
error vs sign, unbiasedness, exact sizes, hostile payloads, decode memory."""

import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fedcomp.compression as fc
from fedcomp.compression.hadamard import fwht_, power_of_two_blocks, random_sign_bits
from fedcomp.compression.wire import pack_header, parse_header

from .helpers import decode_peak_ratio, decodes_or_payload_error, flip_and_cut


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def hadamard(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def reference(x: np.ndarray, seed: int, unbiased: bool) -> np.ndarray:
    """DRIVE (Vargaftik et al. 2021) per power-of-two block, float64, explicit matrices."""
    d = np.where(random_sign_bits(seed, x.size) == 1, 1.0, -1.0)
    out = np.zeros_like(x)
    for off, size in power_of_two_blocks(x.size):
        r = hadamard(size) @ np.diag(d[off:off + size]) / np.sqrt(size)  # orthonormal rotation
        blk = x[off:off + size]
        y = r @ blk
        s = np.where(y >= 0, 1.0, -1.0)
        l1 = np.abs(y).sum()
        scale = 0.0 if l1 == 0 else (blk @ blk / l1 if unbiased else l1 / size)
        out[off:off + size] = scale * (r.T @ s)
    return out


@pytest.mark.parametrize("n", [1, 2, 8, 64, 1024])
def test_fwht_equals_the_hadamard_matrix(n):
    x = randn(n, seed=n).double()
    np.testing.assert_allclose(fwht_(x.clone()).numpy(), hadamard(n) @ x.numpy(), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="power of two"):
        fwht_(torch.zeros(6))


@pytest.mark.parametrize("n", [1 << 12, 1 << 17])
def test_fwht_without_zero_signs_differs_only_in_the_sign_of_zeros(n):
    """Equal entries cancel to exact zeros at every level: the one-op-shorter butterfly gives the same
    numbers, its zeros +0.0 where the exact one gives -0.0."""
    x = torch.from_numpy(random_sign_bits(3, n).astype(np.float32) * 2 - 1).repeat_interleave(2)[:n]
    # pairs of equal entries: every odd output of the first level, and so half the output, is zero
    exact, short = fwht_(x.clone()), fwht_(x.clone(), zero_signs=False)
    assert torch.equal(exact, short)  # -0.0 == +0.0
    nonzero = exact != 0
    assert torch.equal(exact[nonzero].view(torch.int32), short[nonzero].view(torch.int32))
    assert int((exact == 0).sum()) >= n // 2 and bool((short[~nonzero].view(torch.int32) == 0).all())
    assert bool((exact[~nonzero].view(torch.int32) != 0).any())  # the exact one has some -0.0


def test_blocks_cover_n_without_padding():
    assert power_of_two_blocks(1000) == [(0, 512), (512, 256), (768, 128), (896, 64), (960, 32), (992, 8)]
    assert power_of_two_blocks(0) == [] and power_of_two_blocks(1) == [(0, 1)]


@pytest.mark.parametrize("n", [1, 3, 300, 1000])
@pytest.mark.parametrize("unbiased", [False, True])
def test_decoded_equals_drive_reference(n, unbiased):
    x = randn(n, seed=n)
    p = fc.get_compressor("eden", unbiased=unbiased, seed=3).compress(x)
    seed, flag = struct.unpack("<QB", parse_header(p).params)
    assert flag == int(unbiased)
    np.testing.assert_allclose(fc.decompress(p).numpy(), reference(x.double().numpy(), seed, unbiased),
                               rtol=1e-4, atol=1e-5)


def test_biased_scale_is_least_squares():
    x = randn(512, seed=1)
    p = bytearray(fc.get_compressor("eden", seed=0).compress(x))
    h = parse_header(bytes(p))
    (s,) = struct.unpack_from("<f", p, h.body_offset)
    err = {}
    for f in (0.9, 1.0, 1.1):
        struct.pack_into("<f", p, h.body_offset, s * f)
        err[f] = fc.compression_error(x, fc.decompress(bytes(p)))
    assert err[1.0] < err[0.9] and err[1.0] < err[1.1]


def test_gaussian_error_equals_sign_near_0_60():
    x = randn(1 << 16, seed=2)
    eden = fc.compression_error(x, fc.decompress(fc.get_compressor("eden", seed=0).compress(x)))
    sign = fc.compression_error(x, fc.decompress(fc.get_compressor("sign").compress(x)))
    expected = (1 - 2 / np.pi) ** 0.5  # 0.6028
    assert abs(eden - expected) < 0.01 and abs(sign - expected) < 0.01


def test_heavy_tailed_error_far_below_sign():
    g = torch.Generator().manual_seed(4)
    x = randn(1 << 15, seed=4) * torch.exp(2 * torch.randn(1 << 15, generator=g))  # log-normal scale mixture
    eden = fc.compression_error(x, fc.decompress(fc.get_compressor("eden", seed=0).compress(x)))
    sign = fc.compression_error(x, fc.decompress(fc.get_compressor("sign").compress(x)))
    assert sign > 0.9 and eden < 0.65


def test_one_spike_is_exact():
    x = torch.zeros(256)
    x[17] = -3.0
    for unbiased in (False, True):
        out = fc.decompress(fc.get_compressor("eden", unbiased=unbiased, seed=0).compress(x))
        torch.testing.assert_close(out, x, atol=1e-6, rtol=0)


def test_unbiased_scale_averages_to_x():
    x = randn(128, seed=5)
    c = fc.get_compressor("eden", unbiased=True, seed=1)
    mean = torch.stack([fc.decompress(c.compress(x)) for _ in range(2000)]).double().mean(0)
    # one draw has error ~0.76 ||x||; 2000 independent draws: ~0.017 ||x|| if unbiased
    assert float((mean - x).norm() / x.norm()) < 0.05
    biased = fc.get_compressor("eden", seed=1)
    mean_b = torch.stack([fc.decompress(biased.compress(x)) for _ in range(2000)]).double().mean(0)
    assert float(mean_b.norm() / x.norm()) < 0.9  # the least-squares scale shrinks


@pytest.mark.parametrize("n", [0, 1, 7, 1000, 4096, 12345])
def test_size_is_one_bit_per_param_plus_a_scale_per_block(n):
    x = randn(n)
    p = fc.get_compressor("eden", seed=0).compress(x)
    assert len(p) == 10 + 8 + 9 + 4 * n.bit_count() + (n + 7) // 8


def test_rotation_seed_changes_per_call_and_reproduces_from_the_codec_seed():
    x = randn(100)
    a, b = fc.get_compressor("eden", seed=5), fc.get_compressor("eden", seed=5)
    p1, p2 = a.compress(x), a.compress(x)
    assert p1 != p2 and b.compress(x) == p1


def test_bad_parameters():
    with pytest.raises(ValueError, match="unbiased"):
        fc.get_compressor("eden", unbiased="yes")
    with pytest.raises(ValueError, match="seed"):
        fc.get_compressor("eden", seed=-1)


def good(n=300, unbiased=False):
    return fc.get_compressor("eden", unbiased=unbiased, seed=0).compress(randn(n))


def test_every_truncation_and_trailing_bytes_rejected():
    p = good(77)
    for cut in range(len(p)):
        with pytest.raises(fc.PayloadError):
            fc.decompress(p[:cut])
    with pytest.raises(fc.PayloadError, match="trailing"):
        fc.decompress(p + b"\x00")


def test_bad_flag_and_scales_rejected():
    p = good()
    h = parse_header(p)
    seed, _ = struct.unpack("<QB", h.params)
    with pytest.raises(fc.PayloadError, match="unbiased flag"):
        fc.decompress(pack_header(10, torch.float32, h.shape, struct.pack("<QB", seed, 2)) + p[h.body_offset:])
    for bad in (-1.0, float("nan"), float("inf")):
        b = bytearray(p)
        struct.pack_into("<f", b, h.body_offset, bad)
        with pytest.raises(fc.PayloadError, match="scale"):
            fc.decompress(bytes(b))
    b = bytearray(p)
    struct.pack_into("<f", b, h.body_offset, 3e38)  # finite scale, overflowing output
    with pytest.raises(fc.PayloadError, match="non-finite"):
        fc.decompress(bytes(b))


VALID = [good(), good(1, True), good(1000, True), good(4096)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(VALID), st.data())
def test_fuzz_bitflips_and_truncations(p, data):
    decodes_or_payload_error(flip_and_cut(p, data))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 300), max_size=3), st.binary(max_size=12), st.binary(max_size=600))
def test_fuzz_random_headers_and_bodies(shape, params, body):
    decodes_or_payload_error(pack_header(10, torch.float32, tuple(shape), params) + body)


@pytest.mark.parametrize("n", [10**6, 2**20])
def test_decode_peak_memory_at_one_million_entries(n):
    assert decode_peak_ratio(fc.get_compressor("eden", seed=0).compress(randn(n)), n) <= 4.0
