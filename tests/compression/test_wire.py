"""Malformed and hostile payloads: every one raises PayloadError naming the problem."""

import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fedcomp.compression as fc
from fedcomp.compression.wire import MAGIC, pack_header, parse_header

from .helpers import decodes_or_payload_error, flip_and_cut


def payload(name="stc", n=4000, **params):
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    return fc.get_compressor(name, **params).compress(x)


def test_payload_error_is_value_error():
    assert issubclass(fc.PayloadError, ValueError)


@pytest.mark.parametrize("name", fc.available_compressors())
def test_every_truncation_is_rejected(name):
    p = payload(name, n=300)
    for cut in range(len(p)):
        with pytest.raises(fc.PayloadError):
            fc.decompress(p[:cut])


@pytest.mark.parametrize("name", fc.available_compressors())
def test_trailing_bytes_rejected(name):
    with pytest.raises(fc.PayloadError, match="trailing"):
        fc.decompress(payload(name, n=100) + b"\x00")


def test_bad_magic():
    p = payload()
    with pytest.raises(fc.PayloadError, match="bad magic"):
        fc.decompress(b"PK\x03\x04" + p[4:])


def test_pickle_bytes_are_not_a_payload():
    import pickle

    with pytest.raises(fc.PayloadError, match="bad magic"):
        fc.decompress(pickle.dumps(torch.zeros(3)))


@pytest.mark.parametrize("offset, value, match", [
    (4, 9, "version 9"), (5, 200, "unknown codec id 200"), (6, 77, "dtype"), (7, 200, "ndim"),
], ids=["version", "codec-id", "dtype", "ndim"])
def test_a_bad_header_field_is_refused_naming_it(offset, value, match):
    p = bytearray(payload())
    p[offset] = value
    with pytest.raises(fc.PayloadError, match=match):
        fc.decompress(bytes(p))


def test_decompression_bomb_refused_before_allocation():
    bomb = pack_header(0, torch.float32, (2**40, 2**20), b"")
    with pytest.raises(fc.PayloadError, match="above the limit"):
        fc.decompress(bomb)
    ok = fc.get_compressor("none").compress(torch.zeros(100))
    with pytest.raises(fc.PayloadError, match="above the limit of 99"):
        fc.decompress(ok, max_numel=99)
    assert fc.decompress(ok, max_numel=100).shape == (100,)


def test_expected_shape_mismatch():
    p = fc.get_compressor("sign").compress(torch.ones(4, 5))
    with pytest.raises(fc.PayloadError, match="does not match"):
        fc.decompress(p, expected_shape=(5, 4))
    assert fc.decompress(p, expected_shape=(4, 5)).shape == (4, 5)


def _stc_with(params_patch):
    """Re-pack an stc payload of 1000 entries with patched (k, unary_bits, b, mu)."""
    p = payload("stc", n=1000, density=0.05)
    h = parse_header(p)
    k, ub, b, mu = struct.unpack("<QQBf", h.params)
    vals = dict(k=k, ub=ub, b=b, mu=mu)
    vals.update(params_patch)
    params = struct.pack("<QQBf", vals["k"], vals["ub"], vals["b"], vals["mu"])
    return pack_header(4, torch.float32, h.shape, params) + p[h.body_offset:]


@pytest.mark.parametrize(
    "patch,msg",
    [({"k": 10**6}, "exceeds the tensor size"), ({"k": 49}, "codes|truncated|trailing|padding"),
     ({"mu": float("nan")}, "mu"), ({"mu": float("inf")}, "mu"), ({"b": 63}, "Rice parameter"),
     ({"ub": 2**60}, "exceeds the 109 bits")],
)
def test_stc_inconsistent_parameters(patch, msg):
    with pytest.raises(fc.PayloadError, match=msg):
        fc.decompress(_stc_with(patch))


def test_position_out_of_range():
    from fedcomp.compression.positions import encode_positions

    # positions valid for n = 10**6 placed in a payload that claims n = 1000
    b, ub, data = encode_positions(np.array([5, 999_999], dtype=np.int64), 10**6)
    params = struct.pack("<QQBf", 2, ub, b, 1.0)
    bad = pack_header(4, torch.float32, (1000,), params) + data + b"\x03"
    with pytest.raises(fc.PayloadError, match="gap exceeds|out of range|bits exceeds the"):
        fc.decompress(bad)


def test_non_finite_scale_and_values():
    p = bytearray(payload("sign", n=64))
    h = parse_header(bytes(p))
    p[h.body_offset - 4 : h.body_offset] = struct.pack("<f", float("inf"))
    with pytest.raises(fc.PayloadError, match="scale"):
        fc.decompress(bytes(p))
    dense = bytearray(fc.get_compressor("none").compress(torch.zeros(4)))
    dense[-4:] = struct.pack("<f", float("nan"))
    with pytest.raises(fc.PayloadError, match="non-finite"):
        fc.decompress(bytes(dense))


def test_int8_value_minus_128_and_negative_scale():
    p = bytearray(payload("int8", n=10, block_size=10))
    p[-1] = 0x80
    with pytest.raises(fc.PayloadError, match="-128"):
        fc.decompress(bytes(p))


def test_int8_huge_block_size_does_not_allocate():
    h = parse_header(payload("int8", n=10, block_size=10))
    p = payload("int8", n=10, block_size=10)
    params = struct.pack("<I", 2**31 - 1)
    bad = pack_header(8, torch.float32, (10,), params) + p[h.body_offset:]
    out = fc.decompress(bad[: len(bad) - 0])  # 1 block: 4 scale bytes + 10 values = valid length
    assert out.shape == (10,)


def test_non_bytes_input():
    with pytest.raises(fc.PayloadError, match="must be bytes"):
        fc.decompress("FCMP")  # type: ignore[arg-type]


def test_header_starts_with_magic_and_is_small():
    p = fc.get_compressor("sign").compress(torch.zeros(3, 3))
    assert p[:4] == MAGIC
    assert parse_header(p).body_offset == 10 + 16 + 4


VALID = [payload(n, n=200) for n in fc.available_compressors()] + [payload("stc", n=5000, density=0.01)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(VALID), st.data())
def test_fuzz_bitflips_and_truncations_raise_only_payload_error(p, data):
    decodes_or_payload_error(flip_and_cut(p, data))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_random_bytes_raise_only_payload_error(raw):
    decodes_or_payload_error(raw)
    decodes_or_payload_error(MAGIC + bytes([1]) + raw)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 8), st.integers(0, 3), st.lists(st.integers(0, 300), max_size=3), st.binary(max_size=64),
       st.binary(max_size=400))
def test_fuzz_well_formed_headers_with_random_bodies(codec, dtype, shape, params, body):
    hdr = pack_header(codec, [torch.float32, torch.float16, torch.bfloat16, torch.float64][dtype], tuple(shape), params)
    decodes_or_payload_error(hdr + body)
