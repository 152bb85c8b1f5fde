"""qsgd with spacing="exponential" (NUQSGD): levels, adjacent-level rounding, unbiasedness, sizes."""

import struct

import numpy as np
import pytest
import torch

import fedcomp.compression as fc
from fedcomp.compression.qsgd import exponential_levels, exponential_position
from fedcomp.compression.wire import pack_header, parse_header

from .helpers import decode_peak_ratio, decodes_or_payload_error


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_levels_and_fractional_positions():
    np.testing.assert_array_equal(exponential_levels(3), np.array([0, 0.25, 0.5, 1], dtype=np.float32))
    r = torch.tensor([0.0, 0.1, 0.25, 0.375, 0.5, 0.75, 1.0])
    j, p = exponential_position(r, 3)
    assert j.tolist() == [0, 0, 1, 1, 2, 2, 3]
    assert p.tolist() == pytest.approx([0.0, 0.4, 0.0, 0.5, 0.0, 0.5, 0.0])
    j, p = exponential_position(r, 1)  # s = 1: levels {0, 1}
    assert j.tolist() == [0, 0, 0, 0, 0, 0, 1] and p[:6].tolist() == pytest.approx(r[:6].tolist())
    tiny = torch.tensor([1e-45, 2.0**-125, 2.0**-126])  # a subnormal, the lowest two levels of s = 126
    j, p = exponential_position(tiny, 126)
    assert j.tolist() == [0, 1, 0] and p.tolist() == pytest.approx([float(tiny[0]) * 2.0**125, 0.0, 0.5])


def test_decoded_values_are_adjacent_levels_times_the_bucket_norm():
    x = randn(2048, seed=1)
    c = fc.get_compressor("qsgd", levels=5, bucket_size=256, spacing="exponential", seed=0)
    out = fc.decompress(c.compress(x)).numpy()
    levels = exponential_levels(5)
    norms = np.linalg.norm(x.numpy().reshape(8, 256), axis=1).repeat(256)
    q = np.abs(out) / norms
    idx = np.searchsorted(levels, q - 1e-6)
    np.testing.assert_allclose(levels[idx], q, rtol=1e-5)  # every magnitude is a level
    r = np.abs(x.numpy()) / norms
    lo = np.searchsorted(levels, r, side="right") - 1
    assert np.all((idx == lo) | (idx == np.minimum(lo + 1, 5)))  # ... one of r's two neighbours
    assert np.all(np.sign(out[out != 0]) == np.sign(x.numpy()[out != 0]))


def test_unbiased():
    x = randn(256, seed=2)
    c = fc.get_compressor("qsgd", levels=4, bucket_size=64, spacing="exponential", seed=0)
    mean = torch.stack([fc.decompress(c.compress(x)) for _ in range(2000)]).double().mean(0)
    one = fc.compression_error(x, fc.decompress(c.compress(x)))
    assert float((mean - x).norm() / x.norm()) < 3 * one / 2000**0.5


def test_same_bits_as_uniform_and_lower_error_on_gaussian_buckets():
    x = randn(1 << 15, seed=3)
    uni = fc.get_compressor("qsgd", levels=7, seed=0).compress(x)
    exp = fc.get_compressor("qsgd", levels=7, spacing="exponential", seed=0).compress(x)
    assert len(exp) == len(uni) + 1  # one spacing byte in the parameters
    assert len(uni) - parse_header(uni).body_offset == 4 * 64 + 4096 + 3 * 4096
    e_uni = fc.compression_error(x, fc.decompress(uni))
    e_exp = fc.compression_error(x, fc.decompress(exp))
    assert e_exp < 0.5 * e_uni


def test_uniform_payload_is_unchanged_by_the_spacing_option():
    x = randn(1000)
    a = fc.get_compressor("qsgd", levels=15, seed=0).compress(x)
    b = fc.get_compressor("qsgd", levels=15, spacing="uniform", seed=0).compress(x)
    assert a == b and len(parse_header(a).params) == 8


def test_bad_parameters():
    with pytest.raises(ValueError, match="spacing"):
        fc.get_compressor("qsgd", spacing="log")
    with pytest.raises(ValueError, match="levels"):
        fc.get_compressor("qsgd", levels=127, spacing="exponential")
    assert fc.get_compressor("qsgd", levels=126, spacing="exponential").config()["spacing"] == "exponential"


def good(n=300, levels=7):
    return fc.get_compressor("qsgd", levels=levels, bucket_size=64, spacing="exponential", seed=0).compress(randn(n))


def test_malformed_payloads():
    p = good()
    for cut in range(len(p)):
        with pytest.raises(fc.PayloadError):
            fc.decompress(p[:cut])
    h = parse_header(p)
    for params, msg in ((struct.pack("<IIB", 7, 64, 2), "spacing code 2"),
                        (struct.pack("<IIB", 7, 64, 0), "spacing code 0"),
                        (struct.pack("<IIB", 127, 64, 1), "levels 127"), (struct.pack("<IIH", 7, 64, 1), "parameters")):
        with pytest.raises(fc.PayloadError, match=msg):
            fc.decompress(pack_header(7, torch.float32, h.shape, params) + p[h.body_offset:])


def test_fuzz_bitflips_only_payload_error():
    rng = np.random.default_rng(0)
    for p in (good(), good(1000, 3), good(5, 126)):
        for _ in range(300):
            b = bytearray(p)
            for i in rng.integers(0, len(b), size=rng.integers(1, 5)):
                b[i] ^= 1 << int(rng.integers(0, 8))
            decodes_or_payload_error(bytes(b[: rng.integers(0, len(b) + 1)]) if rng.random() < 0.5 else bytes(b))


def test_decode_peak_memory_at_one_million_entries():
    p = fc.get_compressor("qsgd", levels=7, spacing="exponential", seed=0).compress(randn(10**6))
    assert decode_peak_ratio(p, 10**6) <= 4.0
