"""Zeros stay zero: an update with fewer non-zero entries than the codec keeps decodes them to 0."""

import pytest
import torch

import fedcomp.compression as fc


def _few_nonzeros() -> torch.Tensor:
    """262 entries: ten of ±1/±2, the rest 0 or -0.0."""
    x = torch.zeros(262)
    x[1::2] = -0.0
    pos = torch.tensor([3, 17, 40, 41, 99, 100, 150, 201, 222, 261])
    x[pos] = torch.tensor([1.0, -1.0, 2.0, -2.0, 1.0, -1.0, 2.0, -2.0, 1.0, -1.0])
    return x, pos


def test_stc_keeps_only_non_zero_entries_when_fewer_than_k():
    x, pos = _few_nonzeros()
    c = fc.get_compressor("stc", density=0.5)  # k = 131 > 10 non-zeros
    payload = c.compress(x)
    out = fc.decompress(payload)
    mu = float(torch.tensor(1.4))  # mean |kept| over the ten real entries, in float32
    expected = torch.zeros(262)
    expected[pos] = torch.sign(x[pos]) * mu
    assert torch.equal(out, expected)
    p, v = fc.decompress_sparse(payload, max_numel=262)
    assert p.tolist() == pos.tolist() and v.tolist() == (torch.sign(x[pos]) * mu).tolist()


def test_stc_all_zero_update_decodes_to_exact_zeros():
    for x in (torch.zeros(129), -torch.zeros(129)):  # k = 64 by density
        payload = fc.get_compressor("stc", density=0.5).compress(x)
        out = fc.decompress(payload)
        assert out.shape == (129,) and int(torch.count_nonzero(out)) == 0
        p, v = fc.decompress_sparse(payload, max_numel=129)
        assert p.size == 1 and v.tolist() == [0.0]  # one entry with mu = 0


def test_stc_with_at_least_k_non_zeros_is_unchanged():
    """The top-k set holds no zero once there are k non-zeros: k = round(density * n) entries."""
    x, _ = _few_nonzeros()
    payload = fc.get_compressor("stc", density=10 / 262).compress(x)
    p, v = fc.decompress_sparse(payload, max_numel=262)
    assert p.size == 10 and abs(v).tolist() == [float(torch.tensor(1.4))] * 10


@pytest.mark.parametrize("name, params", [("topk", {"density": 0.5}), ("randomk", {"density": 0.5, "seed": 0}),
                                          ("randomk", {"density": 0.5, "rescale": True, "seed": 0})])
def test_sparse_codecs_with_exact_values_keep_zeros_zero(name, params):
    x, pos = _few_nonzeros()
    out = fc.decompress(fc.get_compressor(name, **params).compress(x))
    rest = torch.ones(262, dtype=torch.bool)
    rest[pos] = False
    assert int(torch.count_nonzero(out[rest])) == 0
    if name == "topk":
        assert torch.equal(out[pos], x[pos])


def test_stc_error_feedback_leaves_no_residual_at_zeros():
    x, pos = _few_nonzeros()
    ef = fc.ErrorFeedback(fc.get_compressor("stc", density=0.5))
    ef.compress(x)
    rest = torch.ones(262, dtype=torch.bool)
    rest[pos] = False
    assert int(torch.count_nonzero(ef.residual[rest])) == 0
    expected = (x[pos] - torch.sign(x[pos]) * 1.4).tolist()  # ±0.4 or ±0.6 (float32)
    assert ef.residual[pos].tolist() == expected
