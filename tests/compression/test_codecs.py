"""Structural facts and round trips of every codec."""

import math
import struct

import numpy as np
import pytest
import torch

import fedcomp.compression as fc
from fedcomp.compression.positions import information_bound_bits
from fedcomp.compression.sparse import k_for
from fedcomp.compression.wire import parse_header

ALL = fc.available_compressors()
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def header_len(payload: bytes) -> int:
    return parse_header(payload).body_offset


def randn(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


#: The codec names design.md's public API promises; the registry may hold more (a new codec is its file).
DESIGN_NAMES = ["none", "fp16", "bf16", "sign", "stc", "topk", "randomk", "qsgd", "int8", "powersgd", "eden"]


def test_registry_names_match_design():
    assert sorted(set(DESIGN_NAMES) - set(ALL)) == []
    assert "atomo" in ALL  # the first codec added under the traits rules: compression/atomo.py alone registers it


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (3, 5, 2), ()])
def test_shapes_roundtrip_to_float32_cpu(name, shape):
    x = randn(*shape) if shape != () else torch.tensor(1.5)
    out = fc.decompress(fc.get_compressor(name).compress(x))
    assert out.shape == x.shape
    assert out.dtype == torch.float32 and out.device.type == "cpu"


@pytest.mark.parametrize("name", ALL)
def test_all_zeros_decode_to_exact_zeros(name):
    x = torch.zeros(4, 33)
    out = fc.decompress(fc.get_compressor(name).compress(x))
    assert torch.equal(out, torch.zeros(4, 33))


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_rejected(name, bad):
    x = randn(100)
    x[17] = bad
    with pytest.raises(ValueError, match="non-finite"):
        fc.get_compressor(name).compress(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_none_is_exact_for_every_input_dtype(dtype):
    x = randn(257).to(dtype)
    out = fc.decompress(fc.get_compressor("none").compress(x))
    # float64 travels as float64 (no precision lost); the others decode to float32
    assert torch.equal(out, x if dtype == torch.float64 else x.to(torch.float32))
    assert parse_header(fc.get_compressor("none").compress(x)).dtype == dtype


def test_none_size_is_exactly_32_bits_per_param():
    x = randn(1000)
    p = fc.get_compressor("none").compress(x)
    assert len(p) - header_len(p) == 4000


@pytest.mark.parametrize("name,cast", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_casts_equal_torch_casts(name, cast):
    x = randn(999)
    p = fc.get_compressor(name).compress(x)
    assert len(p) - header_len(p) == 2 * 999
    assert torch.equal(fc.decompress(p), x.to(cast).to(torch.float32))


def test_fp16_saturates_instead_of_inf():
    x = torch.tensor([1e6, -1e6, 1.0])
    out = fc.decompress(fc.get_compressor("fp16").compress(x))
    assert out.tolist() == [65504.0, -65504.0, 1.0]


def test_fp16_input_on_cpu_works():
    x = randn(64).half()
    out = fc.decompress(fc.get_compressor("sign").compress(x))
    assert torch.allclose(out.abs(), torch.full((64,), float(x.float().abs().mean())), rtol=1e-6)


def test_sign_structure_and_size():
    x = randn(10, 101)
    p = fc.get_compressor("sign").compress(x)
    out = fc.decompress(p)
    scale = float(x.abs().mean(dtype=torch.float64))
    assert torch.equal(out.abs(), torch.full_like(x, float(out.abs()[0, 0])))  # one scale
    assert float(out.abs()[0, 0]) == pytest.approx(scale, rel=1e-6)
    assert torch.equal(torch.sign(out), torch.where(x >= 0, 1.0, -1.0))
    assert len(p) - header_len(p) == math.ceil(1010 / 8)


def test_sign_of_zero_is_plus_scale():
    x = torch.tensor([0.0, -2.0, 4.0])
    out = fc.decompress(fc.get_compressor("sign").compress(x))
    assert out.tolist() == [2.0, -2.0, 2.0]


def _sparse_round_trip(name: str, density: float, n: int, seed: int):
    """(input, decoded output, k, indices of the k largest magnitudes) of one sparse codec."""
    x = randn(n, seed=seed)
    out = fc.decompress(fc.get_compressor(name, density=density).compress(x))
    k = k_for(density, x.numel())
    return x, out, k, torch.topk(x.abs(), k).indices


@pytest.mark.parametrize("density", [0.001, 0.01, 0.1, 1.0])
def test_stc_structure(density):
    x, out, k, top = _sparse_round_trip("stc", density, 20000, seed=3)
    nz = torch.nonzero(out).squeeze(1)
    assert nz.numel() == k
    assert set(nz.tolist()) == set(top.tolist())
    mu = x.abs()[top].mean(dtype=torch.float64).float()
    assert torch.equal(out[nz].abs(), torch.full((k,), float(mu)))
    assert torch.equal(torch.sign(out[nz]), torch.sign(x[nz]))


def test_k_rounding_and_clamping():
    assert k_for(0.01, 10) == 1  # round(0.1)=0 -> clamped up to 1
    assert k_for(0.25, 10) == 2  # round(2.5) = 2 (banker's)
    assert k_for(1.0, 10) == 10
    assert k_for(0.5, 0) == 0
    out = fc.decompress(fc.get_compressor("stc", density=1e-9).compress(torch.tensor([1.0, -3.0, 2.0])))
    assert out.tolist() == [0.0, -3.0, 0.0]


@pytest.mark.parametrize("density", [0.0025, 0.01, 0.05, 0.2])
def test_topk_structure_values_bit_identical(density):
    x, out, _, top = _sparse_round_trip("topk", density, 50000, seed=4)
    mask = torch.zeros_like(x, dtype=torch.bool)
    mask[top] = True
    assert torch.equal(out[mask], x[mask])
    assert torch.count_nonzero(out[~mask]) == 0


def test_topk_fp16_values():
    x = randn(5000)
    c = fc.get_compressor("topk", density=0.1, value_dtype="fp16")
    out = fc.decompress(c.compress(x))
    nz = out != 0
    assert int(nz.sum()) == 500
    assert torch.equal(out[nz], x[nz].half().float())


@pytest.mark.parametrize("n,density", [(1_000_000, 1 / 400), (1_000_000, 0.01), (200_000, 0.05)])
@pytest.mark.parametrize("name", ["stc", "topk"])
def test_position_cost_within_3_percent_of_information_bound(name, n, density):
    x = randn(n, seed=7)
    c = fc.get_compressor(name, density=density)
    p = c.compress(x)
    k = k_for(density, n)
    h = parse_header(p)
    _, unary_bits, b = struct.unpack_from("<QQB", h.params)  # k, unary bits, Rice b
    pos_bits = 8 * (math.ceil(unary_bits / 8) + math.ceil(k * b / 8))
    assert pos_bits <= 1.03 * information_bound_bits(k, n)


def test_stc_payload_at_density_1_over_400_is_under_0_029_bits_per_param():
    n = 1_000_000
    p = fc.get_compressor("stc", density=1 / 400).compress(randn(n, seed=8))
    body_bits = 8 * (len(p) - header_len(p))
    assert body_bits / n <= 0.029


def test_randomk_positions_from_seed_and_size():
    x = randn(10000)
    c = fc.get_compressor("randomk", density=0.02, seed=5)
    p = c.compress(x)
    out = fc.decompress(p)
    nz = out != 0
    assert int(nz.sum()) == 200
    assert torch.equal(out[nz], x[nz])
    assert len(p) - header_len(p) == 4 * 200  # values only, no positions


def test_randomk_rescale_is_unbiased():
    x = randn(50, seed=2)
    c = fc.get_compressor("randomk", density=0.2, rescale=True, seed=0)
    mean = torch.stack([fc.decompress(c.compress(x)) for _ in range(4000)]).mean(0)
    # each entry: mean of 4000 draws of (n/k) x_i Bernoulli(k/n); sd = |x_i| * 2 / sqrt(4000)
    assert torch.all((mean - x).abs() <= 5 * x.abs() * 2 / math.sqrt(4000) + 1e-6)


def test_randomk_same_seed_same_positions():
    x = randn(1000)
    a = fc.get_compressor("randomk", density=0.05, seed=11).compress(x)
    b = fc.get_compressor("randomk", density=0.05, seed=11).compress(x)
    assert a == b


@pytest.mark.parametrize("name,params", [("qsgd", {"levels": 4, "bucket_size": 16}), ("int8", {"block_size": 8})])
def test_stochastic_rounding_is_unbiased(name, params):
    x = randn(64, seed=9)
    c = fc.get_compressor(name, seed=1, **params)
    trials = 4000
    outs = torch.stack([fc.decompress(c.compress(x)) for _ in range(trials)])
    mean, sd = outs.mean(0), outs.std(0)
    # 6 standard errors: a deterministic-rounding bug gives a bias of up to half a step.
    assert torch.all((mean - x).abs() <= 6 * sd / math.sqrt(trials) + 1e-6)
    assert float(sd.max()) > 0  # it really is random


def test_int8_structure_and_size():
    x = randn(1000)
    p = fc.get_compressor("int8", block_size=100, seed=0).compress(x)
    out = fc.decompress(p)
    assert len(p) - header_len(p) == 1000 + 4 * 10
    scales = x.view(10, 100).abs().amax(1) / 127
    q = out.view(10, 100) / scales[:, None]
    assert torch.allclose(q, q.round(), atol=1e-3)
    assert float(q.abs().max()) <= 127.0 + 1e-3
    assert torch.all((out - x).view(10, 100).abs() <= scales[:, None] * (1 + 1e-5))


def test_qsgd_structure_and_size():
    x = randn(1024)
    p = fc.get_compressor("qsgd", levels=15, bucket_size=512, seed=0).compress(x)
    out = fc.decompress(p)
    assert len(p) - header_len(p) == 2 * 4 + 1024 // 8 + 1024 * 4 // 8
    norms = x.view(2, 512).norm(dim=1)
    lv = out.view(2, 512).abs() / (norms[:, None] / 15)
    assert torch.allclose(lv, lv.round(), atol=1e-3) and float(lv.max()) <= 15 + 1e-3
    nz = out != 0
    assert torch.equal(torch.sign(out[nz]), torch.sign(x[nz]))


@pytest.mark.parametrize(
    "name,params",
    [("stc", {"density": 0}), ("stc", {"density": 1.5}), ("topk", {"density": -0.1}),
     ("qsgd", {"levels": 0}), ("int8", {"block_size": 0}), ("topk", {"value_dtype": "fp8"}),
     ("randomk", {"density": float("nan")}), ("qsgd", {"levels": 2.5})],
)
def test_bad_parameters_raise_value_error(name, params):
    with pytest.raises(ValueError):
        fc.get_compressor(name, **params)


def test_unknown_codec_and_unknown_parameter():
    with pytest.raises(ValueError, match="unknown compressor"):
        fc.get_compressor("gzip")
    with pytest.raises(ValueError) as err:
        fc.get_compressor("sign", density=0.1)
    assert str(err.value) == "compressor 'sign' takes no parameters, got 'density'"


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [("stc", {"densty": 0.1}, ("compressor 'stc' has no parameter 'densty'; did you mean 'density'? "
                               "(its parameters: ['density'])")),
     ("qsgd", {"levels": 3, "level": 3}, ("compressor 'qsgd' has no parameter 'level'; did you mean 'levels'? "
                                          "(its parameters: ['bucket_size', 'levels', 'seed', 'spacing'])")),
     ("topk", {"colour": 1}, ("compressor 'topk' has no parameter 'colour'; no similar parameter "
                              "(its parameters: ['density', 'value_dtype'])"))],
)
def test_a_misspelt_parameter_names_the_codec_the_closest_and_the_valid_ones(name, params, message):
    with pytest.raises(ValueError) as err:  # was a raw TypeError from the codec's __init__
        fc.get_compressor(name, **params)
    assert str(err.value) == message


def test_compression_error_helper():
    x = torch.tensor([3.0, 4.0])
    assert fc.compression_error(x, torch.zeros(2)) == 1.0
    assert fc.compression_error(x, x) == 0.0
    assert fc.compression_error(torch.zeros(3), torch.zeros(3)) == 0.0
    assert fc.compression_error(x, torch.tensor([3.0, 0.0])) == pytest.approx(0.8)


def test_large_tensor_sampled_selection_is_exact_topk():
    x = randn(1_000_003, seed=12)
    out = fc.decompress(fc.get_compressor("topk", density=0.001).compress(x))
    k = k_for(0.001, x.numel())
    assert set(torch.nonzero(out).squeeze(1).tolist()) == set(torch.topk(x.abs(), k).indices.tolist())


def test_64_bit_positions_encode_beyond_2_pow_31():
    from fedcomp.compression.positions import decode_positions, encode_positions

    n = 2**33
    pos = np.array([0, 5, 2**31 + 7, 2**32 + 1, n - 1], dtype=np.int64)
    b, ub, data = encode_positions(pos, n)
    assert np.array_equal(decode_positions(data, len(pos), n, b, ub), pos)
