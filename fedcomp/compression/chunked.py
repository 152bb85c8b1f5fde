"""Helpers of the codecs' one-pass CPU paths: cache-sized chunks and n-sized buffers.

A fresh torch tensor of a model's size costs a page fault per 4 KiB on the CPU (glibc serves
allocations above 32 MiB from fresh ``mmap``), which is what made most encoders cost many read
passes. The codecs therefore walk their input in chunks of `CHUNK` entries, keeping every
temporary in cache, and write their outputs into buffers numpy allocates (numpy asks the kernel
for huge pages on large arrays: a few faults instead of thousands). Every chunked path performs
the same float operations on every entry as the whole-tensor code it replaced, so payloads are
byte-identical (``tests/compression/test_payload_golden.py``).

Tensors on other devices (CUDA) take a single chunk: their kernels are launched once, as before.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

#: Entries per chunk: 256 KiB of float32, within a core's L2 cache; a multiple of 64, so that
#: chunks of bit streams start on a byte and chunks of ``pack_uint`` streams on a whole group.
CHUNK = 1 << 16


def spans(n: int, chunk: int = CHUNK) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive chunks of ``[0, n)``, each ``chunk`` long but the last."""
    for start in range(0, n, chunk):
        yield start, min(start + chunk, n)


def blocks(n: int, block: int, device: torch.device) -> Iterator[tuple[int, int, int, int]]:
    """Whole blocks of ``block`` entries in chunks: ``(first block, end block, start, stop)``.

    ``[0, n)`` is cut into ``ceil(n / block)`` blocks (the last possibly short); each chunk holds
    ``max(1, CHUNK // block)`` blocks on the CPU, every block at once elsewhere, and covers the
    entries ``[start, stop)``.
    """
    nb = -(-n // block)
    per = max(1, CHUNK // block) if device.type == "cpu" else max(nb, 1)
    for b0 in range(0, nb, per):
        b1 = min(nb, b0 + per)
        yield b0, b1, b0 * block, min(b1 * block, n)


def padded_rows(flat: torch.Tensor, b0: int, b1: int, block: int) -> torch.Tensor:
    """Blocks ``b0 .. b1 - 1`` of ``flat`` as a ``(b1 - b0, block)`` view, the short last block
    zero-padded (a copy of that chunk only)."""
    seg = flat[b0 * block : b1 * block]
    short = (b1 - b0) * block - seg.numel()
    if short:
        seg = torch.nn.functional.pad(seg, (0, short))
    return seg.reshape(b1 - b0, block)


def padded_rows_np(xn: np.ndarray, b0: int, b1: int, block: int) -> np.ndarray:
    """`padded_rows` of a 1-D numpy array ``xn``: blocks ``b0 .. b1 - 1`` as a
    ``(b1 - b0, block)`` view of xn's dtype, the short last block zero-padded (a copy of that
    chunk only)."""
    seg = xn[b0 * block : b1 * block]
    short = (b1 - b0) * block - seg.size
    if short:
        seg = np.concatenate([seg, np.zeros(short, dtype=seg.dtype)])
    return seg.reshape(b1 - b0, block)


def on_cpu(t: torch.Tensor) -> bool:
    """Whether ``t`` takes the chunked numpy path: a CPU tensor (``.numpy()`` works on it)."""
    return t.device.type == "cpu"


def buffer(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised CPU tensor of ``n`` entries whose memory numpy allocated (huge pages).

    Raises
    ------
    TypeError
        A dtype numpy cannot hold (bfloat16).
    """
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    return torch.from_numpy(np.empty(n, dtype=np_dtype))


def float32_out(out: np.ndarray, name: str) -> np.ndarray:
    """A decoder's ``out`` if it is float32.

    Raises
    ------
    ValueError
        Another dtype (codec ``name`` decodes to float32).
    """
    if out.dtype != np.float32:
        raise ValueError(f"decompress: out is {out.dtype}, the {name} payload decodes to float32")
    return out


def join(*parts) -> bytes:
    """One ``bytes`` of the given bytes-like parts (numpy arrays included), copied once."""
    return b"".join(memoryview(p).cast("B") if isinstance(p, np.ndarray) else p for p in parts)
