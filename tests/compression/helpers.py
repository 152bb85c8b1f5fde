"""Shared checks for the codec tests: decode peak memory, and 'only PayloadError' decoding."""

import tracemalloc

import torch

import fedcomp.compression as fc


def decode_peak_ratio(payload: bytes, numel: int) -> float:
    """Peak bytes allocated while decoding ``payload`` (numpy/Python, via tracemalloc) over the
    float32 output's bytes. The payload itself was allocated before tracing started."""
    tracemalloc.start()
    try:
        out = fc.decompress(payload, max_numel=numel)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.numel() == numel
    return peak / (4 * numel)


def decodes_or_payload_error(data: bytes) -> None:
    """``decompress`` either returns a finite float32 tensor or raises PayloadError, nothing else."""
    try:
        out = fc.decompress(data, max_numel=1 << 20)
    except fc.PayloadError:
        return
    # float32, or float64 for a `none` payload of a float64 tensor (float64 travels as float64)
    wide = out.dtype == torch.float64 and fc.parse_header(data, max_numel=1 << 20).dtype == torch.float64
    assert (out.dtype == torch.float32 or wide) and bool(torch.isfinite(out).all())


def flip_and_cut(p: bytes, data) -> bytes:
    """A payload with 1-4 random bit flips, then (half of the time) truncated; ``data`` is
    hypothesis's ``st.data()``."""
    from hypothesis import strategies as st

    b = bytearray(p)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(b) - 1))
        b[i] ^= 1 << data.draw(st.integers(0, 7))
    cut = data.draw(st.integers(0, len(b)))
    return bytes(b[:cut]) if data.draw(st.booleans()) else bytes(b)
