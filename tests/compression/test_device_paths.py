"""The torch paths that int8 and qsgd take on an accelerator, run on the CPU (where CI can run them):
with the CPU generator both read the same draws as the chunked numpy paths, so the payloads must be
byte-identical; a CUDA device (when lent) is covered by test_decompress_out.py."""

import numpy as np
import pytest
import torch

import fedcomp.compression as fc
import fedcomp.compression.int8 as int8_module
import fedcomp.compression.qsgd as qsgd_module

CASES = [
    ("int8", {"block_size": 256}), ("int8", {"block_size": 100}), ("int8", {"block_size": 70_001}),
    ("qsgd", {"levels": 15}), ("qsgd", {"levels": 3, "bucket_size": 100}), ("qsgd", {"levels": 300}),
    ("qsgd", {"levels": 7, "spacing": "exponential"}),
]


@pytest.mark.parametrize("n", [1, 1000, 300_007])
@pytest.mark.parametrize("name,params", CASES)
def test_torch_path_sends_the_bytes_of_the_numpy_path(monkeypatch, name, params, n):
    x = torch.from_numpy(np.random.default_rng(n).standard_normal(n).astype(np.float32))
    x[::97] *= 50.0
    fast = fc.get_compressor(name, **params, seed=7)
    expected = [fast.compress(x), fast.compress(x)]  # twice: the generator continues alike
    module = int8_module if name == "int8" else qsgd_module
    monkeypatch.setattr(module, "on_cpu", lambda t: False)
    slow = fc.get_compressor(name, **params, seed=7)
    assert [slow.compress(x), slow.compress(x)] == expected
