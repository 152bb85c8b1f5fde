"""The Flower-free pieces of fedcomp.secagg: projection, pre-quantization, packing, run config."""

import numpy as np
import pytest

from fedcomp.compression import PayloadError
from fedcomp.config.secagg import SecAggConfig, check_codec_under_secagg
from fedcomp.secagg.encoding import SharedProjection, flower_weight, modulus_bits_for, prequantize
from fedcomp.secagg.protocol_packing import pack_masked, unpack_masked


@pytest.mark.parametrize("dim", [1, 7, 1000, 4096])
def test_rotation_is_orthonormal_and_decode_inverts_encode_at_density_one(dim):
    x = np.random.default_rng(dim).normal(size=dim)
    proj = SharedProjection(dim, 1.0, seed=11, rotate=True)
    values, _rotated = proj.encode(x)
    assert np.isclose(np.linalg.norm(values), np.linalg.norm(x))
    np.testing.assert_allclose(proj.decode(values), x, atol=1e-12)


def test_every_client_derives_the_same_positions_and_other_rounds_differ():
    a, b = SharedProjection(10_000, 0.01, 5), SharedProjection(10_000, 0.01, 5)
    assert a.k == 100 and np.array_equal(a.positions(), b.positions())
    assert len(set(a.positions()) & set(SharedProjection(10_000, 0.01, 6).positions())) < 10


def test_prequantize_lands_on_the_grid_and_is_unbiased():
    c, q = 0.5, 1 << 8
    w = flower_weight(300, 1000.0, q)
    v = np.full(20_000, 0.1234)
    sent, clipped = prequantize(v, w, c, q, np.random.default_rng(0))
    grid = (sent * w + c) * q / (2 * c)
    np.testing.assert_allclose(grid, np.round(grid), atol=1e-9)  # Flower's quantizer is exact on these
    step = 2 * c / q / w
    assert clipped == 0 and np.abs(sent - v).max() < step
    assert abs(sent.mean() - 0.1234) < 4 * step / np.sqrt(len(v))  # stochastic rounding: unbiased
    _, clipped = prequantize(np.array([10.0, -10.0, 0.0]), w, c, q, np.random.default_rng(0))
    assert clipped == 2


def test_weights_and_modulus():
    assert flower_weight(500, 1000.0, 1 << 16) == 0.5
    with pytest.raises(ValueError, match="secagg-max-weight"):
        flower_weight(1001, 1000.0, 1 << 16)
    assert modulus_bits_for(10, 1 << 16) == 20 and modulus_bits_for(2, 1 << 16) == 18


def test_pack_roundtrip_and_malformed_buffers():
    vals = np.random.default_rng(1).integers(0, 1 << 19, size=1001)
    buf = pack_masked(vals, 19)
    assert len(buf) == 15 + (1001 * 19 + 7) // 8
    assert np.array_equal(unpack_masked(buf, 19), vals)
    for bad, msg in [(buf[:-1], "body bytes"), (b"\x93NUMPY" + buf[6:], "magic"), (buf, "bits per value")]:
        with pytest.raises(PayloadError, match=msg):
            unpack_masked(bad, 19 if bad is not buf else 20)
    huge = buf[:7] + (1 << 40).to_bytes(8, "little")
    with pytest.raises(PayloadError, match="claims"):
        unpack_masked(huge, 19)
    with pytest.raises(ValueError, match="outside"):
        pack_masked(np.array([1 << 19]), 19)


def test_run_config_defaults_and_refusals():
    sa = SecAggConfig.from_run_config({})
    assert not sa.enabled and sa.quantization_range == 1 << 16 and sa.modulus_bits == 0 and sa.pack
    for key, value, msg in [("secagg-modulus-bits", 17, "must exceed"), ("secagg-modulus-bits", 40, r"\[0, 32\]"),
                            ("secagg-shares", 2, "must be > 2"), ("secagg-threshold", 1.5, "fraction"),
                            ("secagg-clipping-range", 0.0, "> 0"), ("secagg-rotation", 1, "true or false")]:
        with pytest.raises(ValueError, match=msg):
            SecAggConfig.from_run_config({key: value})
    with pytest.raises(ValueError, match=r"'stc' cannot work under secure aggregation.*\['randomk', 'none'\]"):
        check_codec_under_secagg({"compressor": "stc"})
    with pytest.raises(ValueError, match="'dp' = 'local' is not supported with secagg"):
        check_codec_under_secagg({"compressor": "randomk", "dp": "local"})
    with pytest.raises(ValueError, match="needs error-feedback = false"):
        check_codec_under_secagg({"compressor": "randomk", "dp": "client-level"})
    check_codec_under_secagg({"compressor": "randomk", "dp": "client-level", "error-feedback": False})
    with pytest.raises(ValueError, match="'error-feedback' = 'ef21' is not supported with secagg"):
        check_codec_under_secagg({"compressor": "randomk", "error-feedback": "ef21"})
    check_codec_under_secagg({"compressor": "randomk", "density": 0.015625, "error-feedback": False})
    with pytest.raises(ValueError, match="'batchnorm-stats' = 'codec' is not supported with secagg"):
        check_codec_under_secagg({"compressor": "randomk", "batchnorm-stats": "codec"})
    check_codec_under_secagg({"compressor": "randomk", "batchnorm-stats": "small"})


def test_secagg_server_lr_is_read_and_a_bad_one_is_refused_naming_the_key():
    """Fails on main: the key did not exist (SecAggConfig had no server_lr)."""
    assert SecAggConfig.from_run_config({}).server_lr == 1.0
    assert SecAggConfig.from_run_config({"secagg-server-lr": 3}).server_lr == 3.0
    for bad in (0.0, -2.0, float("nan"), "4", True):
        with pytest.raises(ValueError, match="'secagg-server-lr' must be"):
            SecAggConfig.from_run_config({"secagg-server-lr": bad})


@pytest.mark.parametrize("mw", [0.5, 0.999])
def test_a_max_weight_below_one_is_refused_at_start_up(mw):
    """Below 1 no client can take part (a count >= 1 exceeds it; under DP the count reported is
    int(max_weight) = 0), so the run config is refused instead of every round failing on every client."""
    from fedcomp.config.secagg import SecAggConfig

    with pytest.raises(ValueError,
                       match=rf"'secagg-max-weight' must be >= 1 \(a client's count of examples\), got {mw}"):
        SecAggConfig.from_run_config({"secagg-max-weight": mw})
    assert SecAggConfig.from_run_config({"secagg-max-weight": 1.0}).max_weight == 1.0
