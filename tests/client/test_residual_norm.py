"""``residual-norm`` of an fp16 residual is computed in chunks (no whole fp32 copy), with the right value."""
import numpy as np
import pytest

from fedcomp.client.update import chunked_sq_norm


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("chunk", [1, 7, 1000, 1 << 20])
def test_chunked_sq_norm_equals_the_whole_norm(dtype, chunk):
    a = np.random.default_rng(0).standard_normal((37, 29)).astype(dtype)
    want = float(np.sum(a.astype(np.float64) ** 2))
    assert chunked_sq_norm(a, chunk=chunk) == pytest.approx(want, rel=1e-5)


def test_chunked_sq_norm_of_empty_and_0d():
    assert chunked_sq_norm(np.zeros((0,), np.float16)) == 0.0
    assert chunked_sq_norm(np.array(3.0, np.float16)) == 9.0


def test_fp16_values_beyond_fp16_range_when_squared_do_not_overflow():
    a = np.full(10, 60000.0, np.float16)  # 60000**2 overflows fp16, not the fp32 accumulation
    assert chunked_sq_norm(a, chunk=3) == pytest.approx(10 * 60000.0**2, rel=1e-6)
