"""Codecs at the ends of the float range: huge finite inputs decode to finite values, float64 beyond float32
is named, odd inputs to decompress, block decoding with tails and huge blocks."""

import numpy as np
import pytest
import torch

import fedcomp.compression as fc
from fedcomp.compression.wire import pack_header


@pytest.mark.parametrize("name,value", [("sign", 1e38), ("bf16", 3.4e38), ("int8", float(np.finfo(np.float32).max))])
def test_huge_finite_inputs_decode_to_finite_values(name, value):
    for seed in range(5):
        params = {"seed": seed} if name == "int8" else {}
        out = fc.decompress(fc.get_compressor(name, **params).compress(torch.full((10,), value)))
        assert bool(torch.isfinite(out).all())
        assert float(out.min()) > 0.5 * value


def test_float64_beyond_float32_range_is_named_as_such():
    with pytest.raises(ValueError, match="beyond the float32 range"):
        fc.get_compressor("sign").compress(torch.full((3,), 1e300, dtype=torch.float64))


def test_decompress_odd_inputs_raise_payload_error_or_work():
    with pytest.raises(fc.PayloadError, match="dimension"):
        fc.decompress(pack_header(0, torch.float32, (0, 2**63), b""))
    p = fc.get_compressor("none").compress(torch.arange(4.0))
    strided = memoryview(bytes(b for pair in zip(p, p) for b in pair))[::2]
    assert torch.equal(fc.decompress(strided), torch.arange(4.0))


def test_qsgd_and_int8_block_decoding_handles_tails_and_huge_blocks():
    x = torch.randn(1000)
    for bs in (1, 7, 999, 1000, 1001, 2**31 - 1):
        out = fc.decompress(fc.get_compressor("int8", block_size=bs, seed=0).compress(x))
        assert torch.all((out - x).abs() <= x.abs().max() / 127 * (1 + 1e-5))
        q = fc.decompress(fc.get_compressor("qsgd", bucket_size=bs, levels=255, seed=0).compress(x))
        assert q.shape == x.shape and bool(torch.isfinite(q).all())


@pytest.mark.parametrize("spacing", ["uniform", "exponential"])
def test_qsgd_bucket_of_subnormal_entries_goes_as_zeros_without_overflow(spacing):
    """Found by the DDP hook benchmark: a bucket whose norm is below float32's smallest normal has no finite
    reciprocal; its levels came out of inf * 0 = NaN (numpy warned, the cast was undefined)."""
    import warnings

    x = torch.zeros(300)
    x[:128] = 1e-41  # one whole bucket of subnormal entries (norm ~1.1e-40)
    x[200] = 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = fc.decompress(fc.get_compressor("qsgd", spacing=spacing, seed=0).compress(x))
    assert torch.isfinite(out).all() and (out[:128] == 0).all()
    assert (out - x).abs().max() <= 0.5
