"""The fast CPU path of top-k selection (compression/selection.py): the sampled threshold, the chunked
candidate pass and the exact step by ``np.partition`` give exactly the top-k set ``torch.topk`` gives."""

import numpy as np
import pytest
import torch

import fedcomp.compression as fc
from fedcomp.compression.selection import CHUNK, SAMPLED_MIN_NUMEL, topk_indices


def _reference(x: torch.Tensor, k: int) -> np.ndarray:
    """Sorted positions of the k largest magnitudes by a full ``torch.topk`` (unique without ties)."""
    return np.sort(torch.topk(x.abs(), k).indices.numpy())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("n", [SAMPLED_MIN_NUMEL, 300_001, 1_000_003])
def test_equals_a_full_topk_on_fixed_seeds(seed, n):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy((rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32))
    for k in (1, 2, n // 400, n // 100, n // 16):
        idx = topk_indices(x, k)
        assert idx.dtype == torch.int64 and idx.shape == (k,)
        np.testing.assert_array_equal(idx.numpy(), _reference(x, k))


def test_candidates_at_chunk_edges_and_the_last_element():
    n = 3 * CHUNK + 5
    x = torch.full((n,), 1e-3)
    x[::7] = -2e-3
    big = [0, CHUNK - 1, CHUNK, 2 * CHUNK - 1, 3 * CHUNK, n - 1]
    for i, p in enumerate(big):
        x[p] = (-1.0) ** i * (10.0 + i)
    np.testing.assert_array_equal(topk_indices(x, len(big)).numpy(), big)


def test_ties_at_the_boundary_keep_k_valid_positions():
    rng = np.random.default_rng(3)
    n, k = 1 << 18, 1000
    x = torch.from_numpy(rng.integers(-20, 21, n).astype(np.float32))  # magnitudes 0..20: ties everywhere
    idx = topk_indices(x, k).numpy()
    assert idx.shape == (k,) and np.all(np.diff(idx) > 0)
    mags = x.abs().numpy()
    dropped = np.ones(n, bool)
    dropped[idx] = False
    assert mags[idx].min() >= mags[dropped].max() == 20.0
    np.testing.assert_array_equal(topk_indices(x, k).numpy(), idx)  # deterministic


def test_ties_that_all_fit_are_all_kept():
    n = 1 << 18
    x = torch.full((n,), 0.5)
    x[[5, 70_000, 200_000]] = -3.0  # three tied at the top, k = 3: all of them
    x[[9, 99]] = 2.0
    np.testing.assert_array_equal(topk_indices(x, 3).numpy(), [5, 70_000, 200_000])
    np.testing.assert_array_equal(topk_indices(x, 5).numpy(), [5, 9, 99, 70_000, 200_000])


@pytest.mark.parametrize("k_of_n", [lambda n: n, lambda n: n - 1, lambda n: n // 8])
def test_dense_k_takes_the_full_topk(k_of_n):
    x = torch.from_numpy(np.random.default_rng(4).standard_normal(SAMPLED_MIN_NUMEL).astype(np.float32))
    k = k_of_n(x.numel())
    np.testing.assert_array_equal(topk_indices(x, k).numpy(), _reference(x, k))


@pytest.mark.parametrize("name", ["stc", "topk"])
def test_codecs_on_a_0d_tensor_and_one_element(name):
    c = fc.get_compressor(name, density=0.01)
    for x in (torch.tensor(-3.0), torch.tensor([2.5])):
        out = fc.decompress(c.compress(x))
        assert out.shape == x.shape and float(out.reshape(-1)[0]) == float(x.reshape(-1)[0])


@pytest.mark.parametrize("name", ["stc", "topk"])
def test_fp16_input_selects_as_its_float32_values(name):
    x16 = torch.from_numpy(np.random.default_rng(5).standard_normal(300_000).astype(np.float16))
    c = fc.get_compressor(name, density=1 / 400)
    a, b = fc.decompress_sparse(c.compress(x16)), fc.decompress_sparse(c.compress(x16.float()))
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    x = x16.float()
    idx = a[0]
    dropped = np.ones(x.numel(), bool)
    dropped[idx] = False
    assert x.abs().numpy()[idx].min() >= x.abs().numpy()[dropped].max()  # fp16 ties: still a top-k set


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_is_refused_before_selection(bad):
    x = torch.from_numpy(np.random.default_rng(6).standard_normal(400_000).astype(np.float32))
    x[123_456] = bad
    with pytest.raises(ValueError, match="non-finite"):
        fc.get_compressor("stc", density=1 / 400).compress(x)


def test_a_threshold_from_a_skewed_sample_is_refined_without_a_full_topk(monkeypatch):
    """The strided sample overstates the tail (every 64th entry is drawn from a wider law), so the
    first threshold passes fewer than k entries; the refined one finds the exact top-k set."""
    import fedcomp.compression.selection as sel

    n = 1 << 20
    rng = np.random.default_rng(5)
    x = rng.uniform(0.0, 1.0, n).astype(np.float32)
    wide = rng.random(n) < 1 / 3
    x[wide] *= 10.0
    x[:: n // sel._SAMPLE] = rng.uniform(0.0, 10.0, sel._SAMPLE).astype(np.float32)
    x[1::2] *= -1.0
    t, k = torch.from_numpy(x), n // 100
    first = sel._candidates(t, float(torch.topk(t[:: n // sel._SAMPLE].abs(), int(sel._SAMPLE * 2 * k / n)).values[-1]))
    assert first[0].size < k  # the first threshold is too high
    monkeypatch.setattr(sel, "_torch_topk", lambda *a: pytest.fail("full torch.topk after a refinement"))
    idx, vals = sel.top_k(t, k)
    np.testing.assert_array_equal(idx.numpy(), _reference(t, k))
    np.testing.assert_array_equal(vals.numpy(), x[idx.numpy()])
