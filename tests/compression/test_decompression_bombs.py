"""Decompression bombs. A position stream is bounded from the header before it
is expanded, and decoding any codec at any density peaks at <= 4x the decoded output (n = 1e6)."""

import hashlib
import inspect
import struct
import tracemalloc

import numpy as np
import pytest
import torch

import fedcomp.compression as fc
from fedcomp.compression.positions import CHUNK_BITS, decode_positions, encode_positions
from fedcomp.compression.randomk import random_positions
from fedcomp.compression.wire import pack_header

N = 10**6
DENSITIES = (0.001, 0.01, 0.1, 0.25, 0.3, 0.5, 0.9, 1.0)


def _peak(fn) -> tuple[object, int]:
    """Peak bytes numpy/Python allocate while ``fn`` runs (the decoders allocate only numpy)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        out = fn()
        return out, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def _cases():
    for name in fc.available_compressors():
        params = inspect.signature(fc.CODECS[name]).parameters
        if "density" in params:
            for d in DENSITIES:
                yield name, {"density": d}
                if "value_dtype" in params:
                    yield name, {"density": d, "value_dtype": "fp16"}
                if "rescale" in params:
                    yield name, {"density": d, "rescale": True}
        else:
            yield name, {}
            if "levels" in params:
                yield name, {"levels": 2**16 - 1}  # 16-bit level fields


@pytest.fixture(scope="module")
def update():
    return torch.randn(N, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name,kw", list(_cases()), ids=lambda v: str(v))
def test_decode_peak_memory_is_at_most_4x_the_output(update, name, kw):
    payload = fc.get_compressor(name, **kw).compress(update)
    out, peak = _peak(lambda: fc.decompress(payload))
    assert out.shape == (N,)
    assert peak <= 4 * 4 * N, f"{name} {kw}: decode peaked at {peak / (4 * N):.2f}x the output"


def _topk_payload(n: int, k: int, b: int, unary_bits: int, body: bytes) -> bytes:
    return pack_header(5, torch.float32, (n,), struct.pack("<QQBB", k, unary_bits, b, 0)) + body


def test_a_long_unary_run_for_a_small_tensor_is_refused_before_expanding():
    # 8 MiB of unary stream for a 10-element tensor: refused from the header, allocating ~nothing
    # (before: unpacked to 64 MiB, then refused).
    body = bytes(8 * 2**20 - 1) + b"\x80" + struct.pack("<f", 1.0)
    bomb = _topk_payload(10, 1, 0, 8 * 8 * 2**20, body)
    _, peak = _peak(lambda: pytest.raises(fc.PayloadError, fc.decompress, bomb))
    assert peak < 64 * 1024
    with pytest.raises(fc.PayloadError, match=r"unary stream of 67108864 bits exceeds the 10 bits"):
        fc.decompress(bomb)


@pytest.mark.parametrize("n,b", [(10, 0), (1000, 3), (2**20, 7)])
def test_the_unary_bound_is_exact(n, b):
    # One position at n - 1 needs exactly k + ((n - k) >> b) = 1 + ((n - 1) >> b) unary bits.
    pos = np.array([n - 1], dtype=np.int64)
    gap = n - 1
    q, r = gap >> b, gap & ((1 << b) - 1)
    unary = np.zeros(q + 1, np.uint8)
    unary[-1] = 1
    from fedcomp.compression.bits import pack_bits, pack_uint

    data = pack_bits(unary) + pack_uint(np.array([r]), b)
    assert np.array_equal(decode_positions(data, 1, n, b, q + 1), pos)
    body = data + struct.pack("<f", 2.0)
    out = fc.decompress(_topk_payload(n, 1, b, q + 1, body))
    assert float(out[n - 1]) == 2.0 and float(out.sum()) == 2.0
    with pytest.raises(fc.PayloadError, match="exceeds the"):
        fc.decompress(_topk_payload(n, 1, b, q + 2, pack_bits(np.r_[np.zeros(q + 1, np.uint8), 1])
                                    + pack_uint(np.array([r]), b) + struct.pack("<f", 2.0)))


@pytest.mark.parametrize("k", [1, 7, CHUNK_BITS - 1, CHUNK_BITS, CHUNK_BITS + 1, 300_000, N])
def test_chunked_position_decoding_round_trips(k):
    rng = np.random.default_rng(k)
    pos = np.sort(rng.choice(N, size=k, replace=False)).astype(np.int64)
    b, ub, data = encode_positions(pos, N)
    assert np.array_equal(decode_positions(data, k, N, b, ub), pos)


def test_extra_terminators_across_chunks_are_refused():
    pos = np.arange(0, 2 * CHUNK_BITS, 2, dtype=np.int64)
    b, ub, data = encode_positions(pos, 2 * CHUNK_BITS)
    with pytest.raises(fc.PayloadError, match="more than the declared|codes"):
        decode_positions(data, pos.size - 1, 2 * CHUNK_BITS, b, ub)


# randomk's positions are the wire format (only the seed travels): pinned to the values of the
# implementation before the low-memory rewrite, so old clients and new servers agree.
@pytest.mark.parametrize("seed,n,k,digest", [
    (0, 1000, 10, "8dc757cc7c8c2237"), (1, 1000, 250, "5253268521f3bb61"), (2, 1000, 251, "858ffe7c2190c662"),
    (3, 1000, 999, "b38df7f556360792"), (12345, 10**6, 3000, "0dac7f23b87ba70d"),
    (7, 10**6, 300000, "580988c065a7444b"), (2**63 - 5, 10**5, 24999, "c8f11d20df0f23a6"),
    (9, 1, 1, "af5570f5a1810b7a"), (5, 17, 4, "2da09fe90a46f602")])
def test_randomk_positions_are_unchanged(seed, n, k, digest):
    p = random_positions(seed, n, k)
    assert p.size == k and p.dtype == np.int64
    assert hashlib.sha256(p.tobytes()).hexdigest()[:16] == digest


@pytest.mark.parametrize("name", ["topk", "stc", "randomk"])
@pytest.mark.parametrize("density", [0.01, 0.3, 1.0])
def test_sparse_decode_peaks_at_most_4x_its_output(update, name, density):
    from fedcomp.compression.decoding import decompress_sparse

    payload = fc.get_compressor(name, density=density).compress(update)
    (pos, vals), peak = _peak(lambda: decompress_sparse(payload))
    dense = fc.decompress(payload).numpy()
    assert np.array_equal(np.flatnonzero(dense), pos[vals != 0]) and np.array_equal(dense[pos], vals)
    # 4x the k entries; randomk also holds its n-byte position mask and one step (2**16) of draws.
    extra = N + 2**21 if name == "randomk" else 0
    assert peak <= 4 * (pos.nbytes + vals.nbytes) + extra
