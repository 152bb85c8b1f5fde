"""``decompress(payload, out=...)``: decoding into a caller's buffer, with no allocation of the tensor's size."""

import tracemalloc

import numpy as np
import pytest
import torch

import fedcomp.compression as fc

N = 100_003  # not a multiple of 8, of a block or of a bucket

#: Every registered codec with its options (seeded where the codec takes a seed).
CASES = [("none", {}), ("fp16", {}), ("bf16", {}), ("sign", {}), ("int8", {"block_size": 100}),
         ("qsgd", {}), ("qsgd", {"levels": 7, "spacing": "exponential"}), ("eden", {}),
         ("stc", {"density": 0.01}), ("topk", {"density": 0.01}), ("randomk", {"density": 0.3}),
         ("powersgd", {"rank": 2}), ("atomo", {}), ("randsign", {"density": 0.3})]


def _payload(name: str, params: dict, x: torch.Tensor) -> bytes:
    seeded = {"seed": 0} if fc.CODECS[name].seeded else {}
    return fc.get_compressor(name, **params, **seeded).compress(x)


def test_every_codec_is_covered():
    assert {name for name, _ in CASES} == set(fc.available_compressors())


@pytest.mark.parametrize("name,params", CASES)
def test_out_holds_exactly_what_a_fresh_decode_returns(name, params):
    x = torch.randn(N, generator=torch.Generator().manual_seed(1))
    if fc.CODECS[name].per_tensor_only:
        x = x[: 300 * 333].reshape(300, 333)
    p = _payload(name, params, x)
    fresh = fc.decompress(p)
    buf = torch.full((x.numel(),), float("nan"))  # stale contents must not leak through
    got = fc.decompress(p, out=buf)
    assert got is buf
    assert np.array_equal(buf.numpy().view(np.uint32), fresh.reshape(-1).numpy().view(np.uint32))


def test_out_of_another_shape_with_the_same_numel_is_filled_in_place():
    x = torch.randn(6, 5)
    p = fc.get_compressor("sign").compress(x)
    buf = torch.empty(3, 10)
    assert fc.decompress(p, out=buf) is buf and buf.shape == (3, 10)
    assert torch.equal(buf.reshape(6, 5), fc.decompress(p))


@pytest.mark.parametrize("bad,match", [
    (torch.empty(99), "99 entries"),
    (torch.empty(100, dtype=torch.float16), "float32 or float64"),
    (torch.empty(200)[::2], "not contiguous"),
])
def test_a_wrong_out_is_refused_naming_it(bad, match):
    p = fc.get_compressor("sign").compress(torch.randn(100))
    with pytest.raises(ValueError, match=match):
        fc.decompress(p, out=bad)
    with pytest.raises(TypeError, match="torch.Tensor"):
        fc.decompress(p, out=np.empty(100, dtype=np.float32))


def test_out_dtype_must_be_the_decoded_dtype():
    wide = fc.get_compressor("none").compress(torch.randn(10, dtype=torch.float64))
    buf = torch.empty(10, dtype=torch.float64)
    assert torch.equal(fc.decompress(wide, out=buf), fc.decompress(wide))
    with pytest.raises(ValueError, match="float64"):
        fc.decompress(wide, out=torch.empty(10))
    with pytest.raises(ValueError, match="float32"):
        fc.decompress(fc.get_compressor("fp16").compress(torch.randn(10)), out=torch.empty(10, dtype=torch.float64))


def test_a_malformed_payload_still_raises_payload_error():
    p = bytearray(fc.get_compressor("int8", seed=0).compress(torch.randn(1000)))
    p[-1] = 0x80  # an int8 value of -128
    with pytest.raises(fc.PayloadError, match="-128"):
        fc.decompress(bytes(p), out=torch.empty(1000))
    nan_scale = bytearray(fc.get_compressor("sign").compress(torch.randn(1000)))
    with pytest.raises(fc.PayloadError):
        fc.decompress(bytes(nan_scale[:-1]), out=torch.empty(1000))


@pytest.mark.parametrize("name,params", [("sign", {}), ("fp16", {}), ("bf16", {}), ("int8", {}), ("qsgd", {}),
                                         ("eden", {}), ("stc", {"density": 0.01}), ("topk", {"density": 0.01})])
def test_decoding_into_out_allocates_far_less_than_the_output(name, params):
    """The chunked decoders write straight into ``out``: their temporaries stay a small fraction of
    the decoded size (a fresh decode allocates the whole output)."""
    n = 1 << 20
    p = _payload(name, params, torch.randn(n, generator=torch.Generator().manual_seed(2)))
    buf = torch.empty(n)
    tracemalloc.start()
    try:
        fc.decompress(p, out=buf)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= 0.3 * 4 * n, f"{name}: peak {peak / (4 * n):.2f}x the output"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
@pytest.mark.parametrize("name,params", CASES)
def test_cuda_inputs_take_the_device_paths(name, params):
    """A CUDA tensor goes through each codec's device path (one chunk, no numpy views): the payload
    decodes, with ``out=`` too; the casts send the very bytes the CPU path sends."""
    x = torch.randn(N, generator=torch.Generator().manual_seed(3))
    if fc.CODECS[name].per_tensor_only:
        x = x[: 300 * 333].reshape(300, 333)
    p = _payload(name, params, x.cuda())
    assert torch.equal(fc.decompress(p, out=torch.empty(x.numel())).reshape(x.shape), fc.decompress(p))
    if name in ("none", "fp16", "bf16"):
        assert p == _payload(name, params, x)


def _overlapping(p: bytes, numel: int, where: str) -> tuple[bytearray, torch.Tensor]:
    """A writable copy of payload ``p`` and a float32 ``out`` of ``numel`` entries in the same memory:
    ``out`` starting at the payload's first byte ("start"), or ending at its last byte ("end")."""
    size = max(4 * numel, len(p))
    backing = torch.zeros(size // 4 + 2, dtype=torch.float32)
    raw = backing.numpy().view(np.uint8)
    if where == "start":
        raw[: len(p)] = np.frombuffer(p, dtype=np.uint8)
        return memoryview(raw[: len(p)]), backing[:numel]
    start = raw.size - len(p)
    raw[start:] = np.frombuffer(p, dtype=np.uint8)
    return memoryview(raw[start:]), backing[backing.numel() - numel:]


@pytest.mark.parametrize("where", ["start", "end"])
@pytest.mark.parametrize("name,params", CASES)
def test_out_sharing_memory_with_the_payload_decodes_what_a_fresh_decode_returns(name, params, where):
    x = torch.randn(4096, generator=torch.Generator().manual_seed(2))
    if fc.CODECS[name].per_tensor_only:
        x = x.reshape(64, 64)
    p = _payload(name, params, x)
    fresh = fc.decompress(p).reshape(-1)
    view, out = _overlapping(p, x.numel(), where)
    assert np.may_share_memory(np.asarray(view), out.numpy())
    got = fc.decompress(view, out=out)
    assert got is out
    assert np.array_equal(out.numpy().view(np.uint32), fresh.numpy().view(np.uint32))
