"""ATOMO (Wang et al., NeurIPS 2018) on the SVD: unbiased, exact within its budget, every shape and
dtype, its payload size, malformed payloads refused, and a federation that runs with it."""

import json
import struct

import numpy as np
import pytest
import torch

import fedcomp.compression as fc
from fedcomp.compression.atomo import atom_probabilities
from fedcomp.compression.wire import pack_header
from tests.compression.helpers import decode_peak_ratio, decodes_or_payload_error


def test_probabilities_sum_to_the_budget_and_cap_at_one():
    p = atom_probabilities(torch.tensor([10.0, 1.0, 1.0, 1.0, 0.0]), 2)
    assert p.tolist() == pytest.approx([1.0, 1 / 3, 1 / 3, 1 / 3, 0.0])
    p = atom_probabilities(torch.tensor([3.0, 2.0, 1.0]), 2)  # no cap: p_i = s sigma_i / sum sigma
    assert p.tolist() == pytest.approx([1.0, 2 / 3, 1 / 3])
    sigma = torch.sort(torch.rand(40), descending=True).values
    for s in (1, 3, 10, 39):
        p = atom_probabilities(sigma, s)
        assert float(p.sum()) == pytest.approx(s, rel=1e-5) and bool(((p > 0) & (p <= 1)).all())
    assert atom_probabilities(torch.tensor([2.0, 1.0, 0.0]), 5).tolist() == [1.0, 1.0, 0.0]


def test_unbiased_over_many_seeds():
    """The mean of N decodes is within 5 standard errors of M, entry by entry (the standard error
    estimated from the decodes themselves)."""
    g = torch.Generator().manual_seed(0)
    m = torch.randn(12, 16, generator=g)
    n = 600
    outs = torch.stack([fc.decompress(fc.get_compressor("atomo", atoms=2, seed=s).compress(m)) for s in range(n)])
    mean, se = outs.double().mean(0), outs.double().std(0) / n**0.5
    assert bool(((mean - m.double()).abs() <= 5 * se + 1e-5).all())
    assert float((mean - m).norm() / m.norm()) < 0.15


@pytest.mark.parametrize("rank,atoms", [(1, 1), (3, 3), (3, 5), (0, 2)])
def test_exact_when_the_budget_covers_the_rank(rank, atoms):
    g = torch.Generator().manual_seed(rank)
    m = torch.randn(60, rank, generator=g) @ torch.randn(rank, 50, generator=g)
    out = fc.decompress(fc.get_compressor("atomo", atoms=atoms, seed=0).compress(m))
    assert torch.allclose(out, m, atol=1e-4 * max(1.0, float(m.abs().max())))


@pytest.mark.parametrize("shape", [(), (1,), (7,), (0, 5), (3, 3), (64, 30), (16, 3, 3, 3), (8, 4, 5, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_round_trip_keeps_shape(shape, dtype):
    x = torch.randn(shape).to(dtype)
    out = fc.decompress(fc.get_compressor("atomo", seed=0).compress(x))
    assert out.shape == x.shape and bool(torch.isfinite(out).all())


def test_vectors_and_thin_matrices_go_through_the_fallback_exactly():
    c = fc.get_compressor("atomo", atoms=2, seed=0)
    for shape in [(), (500,), (3, 3), (4, 100)]:  # 2 * (4 + 100 + 1) * 2 >= 400: no saving
        x = torch.randn(shape)
        p = c.compress(x)
        assert fc.codec_name(p) == "none" and torch.equal(fc.decompress(p), x)
    assert fc.codec_name(fc.get_compressor("atomo", fallback="fp16").compress(torch.randn(9))) == "fp16"


@pytest.mark.parametrize("shape", [(64, 30), (16, 3, 3, 3), (100, 100)])
def test_payload_size_formula(shape):
    m, n = shape[0], int(np.prod(shape[1:]))
    p = fc.get_compressor("atomo", atoms=2, seed=1).compress(torch.randn(shape))
    (k,) = struct.unpack("<I", fc.parse_header(p).params)
    assert 0 <= k <= min(m, n)
    assert len(p) == 10 + 8 * len(shape) + 4 + 4 * k * (m + n + 1)


def test_same_seed_same_payload_and_the_draw_moves_on():
    x = torch.randn(40, 30)
    a, b = fc.get_compressor("atomo", seed=7), fc.get_compressor("atomo", seed=7)
    first = a.compress(x)
    assert first == b.compress(x)
    assert any(a.compress(x) != first for _ in range(20))


def _payload(shape, k, body):
    return pack_header(11, torch.float32, shape, struct.pack("<I", k)) + body


@pytest.mark.parametrize("data,what", [
    (_payload((4, 5), 1, b"\0" * (4 * 10 - 1)), "truncated"),
    (_payload((4, 5), 1, b"\0" * (4 * 10 + 1)), "trailing"),
    (_payload((4, 5), 5, b"\0" * (4 * 50)), "exceed"),
    (_payload((20,), 1, b"\0" * 88), "not a matrix"),
    (pack_header(11, torch.float32, (4, 5), b"\0\0") + b"", "parameters must be 4 bytes"),
    (_payload((4, 5), 1, np.full(10, np.inf, dtype="<f4").tobytes()), "non-finite"),
    (_payload((2, 2), 1, np.full(5, 3e38, dtype="<f4").tobytes()), "non-finite"),
])
def test_malformed_payloads_raise_payload_error(data, what):
    with pytest.raises(fc.PayloadError, match=what):
        fc.decompress(data)


def test_bit_flips_decode_or_raise_payload_error():
    p = fc.get_compressor("atomo", atoms=3, seed=0).compress(torch.randn(30, 20))
    rng = np.random.default_rng(0)
    for _ in range(300):
        b = bytearray(p)
        b[int(rng.integers(0, len(b)))] ^= 1 << int(rng.integers(0, 8))
        decodes_or_payload_error(bytes(b[: int(rng.integers(0, len(b) + 1))]) if rng.random() < 0.3 else bytes(b))


def test_options_come_from_the_codec_declaration():
    from fedcomp.config import CODEC_DEFAULTS, CodecConfig

    assert CODEC_DEFAULTS["atomo-atoms"] == 2
    cfg = CodecConfig.from_mapping({"compressor": "atomo", "atomo-atoms": 3, "error-feedback": False})
    assert cfg.scope == "tensor" and cfg.build(seed=0).config() == {"atoms": 3, "fallback": "none"}
    with pytest.raises(ValueError, match="'atomo-atoms' must be in"):
        CodecConfig.from_mapping({"compressor": "atomo", "atomo-atoms": 0})
    with pytest.raises(ValueError, match="'selection' must be 'tensor' or 'auto' with compressor 'atomo'"):
        CodecConfig.from_mapping({"compressor": "atomo", "selection": "model", "error-feedback": False})
    with pytest.raises(ValueError, match="'error-feedback': atomo .* turn error feedback off"):
        CodecConfig.from_mapping({"compressor": "atomo"})


def test_a_federation_runs_with_atomo(tmp_path):
    from flwr.app import Context, RecordDict

    from fedcomp.app.client_app import app as client_app
    from fedcomp.app.server_app import main
    from fedcomp.run.inprocess_grid import InProcessGrid

    rc = {"results-dir": str(tmp_path), "compressor": "atomo", "atomo-atoms": 2, "error-feedback": False,
          "num-server-rounds": 2, "batch-size": 64, "fraction-evaluate": 0.0}
    main(InProcessGrid(client_app, 2, rc), Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                                                   run_config=rc))
    rounds = json.loads((tmp_path / "metrics.json").read_text())["rounds"]
    assert len(rounds) == 3 and all(0.0 <= r["accuracy"] <= 1.0 for r in rounds)
    assert all(0 < r["upload-bytes"] for r in rounds[1:])
    assert all(r["compression-ratio"] > 1.0 for r in rounds[1:])


def test_entries_near_the_float32_limit_are_not_zeroed():
    """An entry above 2**127 once made the scale 2**128 (inf in float32): every atom vanished, k = 0."""
    x = torch.zeros(64, 64)
    x[0, 0], x[5, 7] = 2e38, 1.0
    c = fc.get_compressor("atomo", atoms=64, seed=0)
    out = fc.decompress(c.compress(x))
    assert float(out[0, 0]) == pytest.approx(2e38, rel=1e-5)
    assert torch.isfinite(out).all()


def test_weights_beyond_float32_are_refused_naming_the_magnitude():
    with pytest.raises(ValueError, match=r"^atomo: the input's magnitude \(max \|x\| = 1e\+37\) is too large for "
                                         r"float32 atom weights \(sigma / p\) of a 64 x 64 matrix"):
        fc.get_compressor("atomo", atoms=2, seed=0).compress(torch.full((64, 64), 1e37))


def test_matrix_decode_peak_is_at_most_the_output_and_its_payload():
    """The decoder writes the product once (no float32 copy of it): peak <= 1.5x the output."""
    x = torch.randn(1000, 1000, generator=torch.Generator().manual_seed(0))
    p = fc.get_compressor("atomo", atoms=4, seed=0).compress(x)
    assert fc.codec_name(p) == "atomo"
    assert decode_peak_ratio(p, 10**6) <= 1.5


def test_no_atom_kept_decodes_to_zeros_of_the_shape():
    h = pack_header(11, torch.float32, (300, 200), struct.pack("<I", 0))
    out = fc.decompress(h)
    assert out.shape == (300, 200) and not out.any()
