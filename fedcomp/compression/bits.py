"""Vectorised bit packing with numpy (``np.packbits``/``np.unpackbits``, little bit order) and, for
tensors on an accelerator, with torch on their own device.

Every function here works on whole arrays; there is no per-element Python loop.
"""

from __future__ import annotations

import numpy as np
import torch

from fedcomp.compression.errors import PayloadError

_BYTE_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def nbytes_for_bits(nbits: int) -> int:
    """Bytes needed for ``nbits`` bits (``ceil(nbits / 8)``)."""
    return (nbits + 7) // 8


def pack_bits(bits: np.ndarray) -> bytes:
    """Pack a boolean/0-1 array into ``ceil(len/8)`` bytes, bit i of the stream at bit i%8 of byte i//8.

    Parameters
    ----------
    bits : np.ndarray
        1-D array of bool or uint8 in {0, 1}, length m.

    Returns
    -------
    bytes
        ``ceil(m / 8)`` bytes; padding bits in the last byte are zero.
    """
    return np.packbits(bits.astype(np.bool_, copy=False), bitorder="little").tobytes()


def pack_bits_array(bits: np.ndarray) -> np.ndarray:
    """`pack_bits` as a uint8 array (no copy into ``bytes``)."""
    return np.packbits(bits.astype(np.bool_, copy=False), bitorder="little")


def pack_bits_on_device(bits: torch.Tensor) -> bytes:
    """Pack a 1-D bool tensor little-endian bitwise on its own device; move only bytes."""
    n = bits.numel()
    if bits.device.type == "cpu":
        return np.packbits(bits.numpy(), bitorder="little").tobytes()
    pad = (-n) % 8
    b = torch.nn.functional.pad(bits.to(torch.uint8), (0, pad)).view(-1, 8)
    packed = (b * _BYTE_WEIGHTS.to(bits.device)).sum(dim=1, dtype=torch.uint8)
    return packed.cpu().numpy().tobytes()


def unpack_bits(buf: memoryview | bytes, count: int, what: str) -> np.ndarray:
    """Inverse of `pack_bits`.

    Parameters
    ----------
    buf : bytes-like
        Exactly ``ceil(count / 8)`` bytes.
    count : int
        Number of bits to return.
    what : str
        Field name for error messages.

    Returns
    -------
    np.ndarray
        uint8 array of 0/1, shape ``(count,)``.

    Raises
    ------
    PayloadError
        If the buffer length is wrong or a padding bit is set (non-canonical encoding).
    """
    raw = check_padding(buf, count, what)
    return np.unpackbits(raw, count=count, bitorder="little")


def check_padding(buf: memoryview | bytes, count: int, what: str) -> np.ndarray:
    """The checks of `unpack_bits` without the unpacking: ``buf`` as a uint8 array.

    Raises
    ------
    PayloadError
        If the buffer length is not ``ceil(count / 8)`` or a padding bit is set.
    """
    raw = np.frombuffer(buf, dtype=np.uint8)
    if raw.size != nbytes_for_bits(count):
        raise PayloadError(f"{what}: expected {nbytes_for_bits(count)} bytes for {count} bits, got {raw.size}")
    pad = raw.size * 8 - count
    if pad and int(raw[-1]) >> (8 - pad):
        raise PayloadError(f"{what}: padding bits after bit {count} are not zero")
    return raw


def pack_uint(values: np.ndarray, width: int) -> bytes:
    """Pack unsigned integers at a fixed bit width.

    Parameters
    ----------
    values : np.ndarray
        1-D integer array, every entry in ``[0, 2**width)``; length m.
    width : int
        Bits per value, 0..64. Width 0 packs nothing.

    Returns
    -------
    bytes
        ``ceil(m * width / 8)`` bytes, value i occupying bits ``[i*width, (i+1)*width)``
        least significant bit first.
    """
    if width == 0 or values.size == 0:
        return b""
    if width == 8:
        return values.astype(np.uint8).tobytes()
    return pack_uint_array(values, width).tobytes()


#: Values per group of the packers: 8 values of w bits fill exactly w bytes.
_GROUP = 8
#: Values packed/unpacked per step (a multiple of the group): bounds the temporaries.
PACK_CHUNK = 1 << 16


def _word_plan(width: int) -> list[tuple[int, int, int]]:
    """For value t of a group: (word, bit offset in that word, bits that spill into the next word)."""
    return [(t * width // 64, t * width % 64, max(0, t * width % 64 + width - 64)) for t in range(_GROUP)]


def pack_uint_array(values: np.ndarray, width: int) -> np.ndarray:
    """`pack_uint`'s bytes as a uint8 array, packed a group of 8 values at a time.

    The 8 values of a group are OR-ed at bit offsets ``0, w, ..., 7w`` into ``ceil(w / 8)``
    little-endian 64-bit words, whose first w bytes are the group's bytes; chunks of
    `PACK_CHUNK` values bound the temporaries. ``values``: 1-D, every entry in
    ``[0, 2**width)``; ``width`` 1..64.
    """
    m = values.size
    out = np.empty(nbytes_for_bits(m * width), dtype=np.uint8)
    if 8 % width == 0:  # 1, 2, 4 (or 8) bits: 8 / width values per byte, in uint8 arithmetic
        per = 8 // width
        for start in range(0, m, PACK_CHUNK):
            c = min(PACK_CHUNK, m - start)
            v = np.zeros(-(-c // per) * per, dtype=np.uint8)
            v[:c] = values[start : start + c]
            acc = v[0::per].copy()
            for t in range(1, per):
                acc |= v[t::per] << np.uint8(t * width)
            out[start // per : start // per + acc.size] = acc
        return out
    words = -(-_GROUP * width // 64)
    plan = _word_plan(width)
    for start in range(0, m, PACK_CHUNK):
        c = min(PACK_CHUNK, m - start)
        g = -(-c // _GROUP)
        grp = np.zeros((g, _GROUP), dtype=np.uint64)
        grp.reshape(-1)[:c] = values[start : start + c]
        acc = np.zeros((g, words), dtype="<u8")
        for t, (w, off, spill) in enumerate(plan):
            col = grp[:, t]
            acc[:, w] |= col << np.uint64(off) if off else col
            if spill:
                acc[:, w + 1] |= col >> np.uint64(64 - off)
        nbytes = nbytes_for_bits(c * width)
        first = start * width // 8
        out[first : first + nbytes] = acc.view(np.uint8).reshape(g, 8 * words)[:, :width].reshape(-1)[:nbytes]
    return out


class UintStreamWriter:
    """Packs ``count`` fixed-width unsigned values pushed chunk by chunk into one `pack_uint`
    stream (width 1: `pack_bits`' stream), so that no n-sized array of the values is held.

    Values are packed 8 at a time (a whole group: byte-aligned at every width); up to 7 wait for
    the next `push`. The bytes equal those of one `pack_uint_array` over all values.

    Parameters
    ----------
    count : int
        Values the stream will hold.
    width : int
        Bits per value, 1..64.
    """

    def __init__(self, count: int, width: int) -> None:
        self.width = width
        self.out = np.empty(nbytes_for_bits(count * width), dtype=np.uint8)
        self._done = 0  # values packed so far, a multiple of 8 until `finish`
        self._pending: np.ndarray | None = None

    def push(self, values: np.ndarray) -> None:
        """Append ``values`` (1-D, entries in ``[0, 2**width)``; bool for width 1)."""
        if self._pending is not None and self._pending.size:
            values = np.concatenate([self._pending, values])
        whole = values.size - values.size % _GROUP
        if whole:
            self._write(values[:whole])
        self._pending = values[whole:].copy()

    def finish(self) -> np.ndarray:
        """The packed stream (uint8), after the last values and their zero padding."""
        if self._pending is not None and self._pending.size:
            self._write(self._pending)
            self._pending = None
        return self.out

    def _write(self, values: np.ndarray) -> None:
        first = self._done * self.width // 8
        packed = pack_bits_array(values) if self.width == 1 else pack_uint_array(values, self.width)
        self.out[first : first + packed.size] = packed
        self._done += values.size


def uint_dtype(width: int) -> np.dtype:
    """Smallest unsigned dtype holding ``width``-bit values (uint8, uint16, uint32 or uint64)."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if width <= 8 * np.dtype(dt).itemsize:
            return np.dtype(dt)
    return np.dtype(np.uint64)


def unpack_uint_range(raw: np.ndarray, first: int, count: int, width: int) -> np.ndarray:
    """Values ``first .. first + count - 1`` of a `pack_uint` stream (no length checks).

    Parameters
    ----------
    raw : np.ndarray
        uint8, the whole packed stream.
    first, count : int
        Index of the first value and number of values; the caller has checked that the stream
        holds them.
    width : int
        Bits per value, 1..64.

    Returns
    -------
    np.ndarray
        Shape ``(count,)``, dtype `uint_dtype` of ``width``. Decoded a group of 8 values at a
        time (the inverse of `pack_uint_array`), `PACK_CHUNK` values per step: the
        temporaries stay below ``24 * PACK_CHUNK`` bytes whatever the count.
    """
    if width == 8:
        return raw[first : first + count].copy()
    out = np.empty(count, dtype=uint_dtype(width))
    if count == 0:
        return out
    if 8 % width == 0:  # 1, 2 or 4 bits: 8 / width values per byte, in uint8 arithmetic
        per, mask = 8 // width, np.uint8((1 << width) - 1)
        for begin in range(first, first + count, PACK_CHUNK):
            end = min(begin + PACK_CHUNK, first + count)
            src = raw[begin // per : -(-end // per)]
            vals = np.empty((src.size, per), dtype=np.uint8)
            for t in range(per):
                np.bitwise_and(src >> np.uint8(t * width), mask, out=vals[:, t])
            lead = begin % per
            out[begin - first : end - first] = vals.reshape(-1)[lead : lead + end - begin]
        return out
    words = -(-_GROUP * width // 64)
    plan = _word_plan(width)
    mask = np.uint64((1 << width) - 1)
    for begin in range(first, first + count, PACK_CHUNK):  # the chunk's whole groups, then its slice
        end = min(begin + PACK_CHUNK, first + count)
        ga, gb = begin // _GROUP, -(-end // _GROUP)
        grp = np.zeros((gb - ga, 8 * words), dtype=np.uint8)
        src = raw[ga * width : gb * width]
        full = src.size // width
        grp[:full, :width] = src[: full * width].reshape(full, width)
        if full < gb - ga:  # the stream's last, partial group
            grp[full, : src.size - full * width] = src[full * width :]
        acc = grp.view("<u8")
        vals = np.empty((gb - ga, _GROUP), dtype=np.uint64)
        for t, (w, off, spill) in enumerate(plan):
            col = acc[:, w] >> np.uint64(off) if off else acc[:, w].copy()
            if spill:
                col |= acc[:, w + 1] << np.uint64(64 - off)
            if width < 64:
                col &= mask
            vals[:, t] = col
        out[begin - first : end - first] = vals.reshape(-1)[begin - ga * _GROUP : end - ga * _GROUP]
    return out


def unpack_uint(buf: memoryview | bytes, count: int, width: int, what: str) -> np.ndarray:
    """Inverse of `pack_uint`, in chunks of `PACK_CHUNK` values.

    Returns
    -------
    np.ndarray
        Shape ``(count,)``, dtype `uint_dtype` of ``width`` (uint8 up to 8 bits, uint16 up
        to 16, ...; uint64 for width 0). Peak memory: the result plus a bounded chunk.

    Raises
    ------
    PayloadError
        If the buffer has the wrong length or non-zero padding bits.
    """
    if width == 0 or count == 0:
        if len(buf) != 0:
            raise PayloadError(f"{what}: expected 0 bytes, got {len(buf)}")
        return np.zeros(count, dtype=np.uint64)
    return unpack_uint_range(check_uint_stream(buf, count, width, what), 0, count, width)


def check_uint_stream(buf: memoryview | bytes, count: int, width: int, what: str) -> np.ndarray:
    """The checks of `unpack_uint` (``count >= 1``, ``width >= 1``) without the unpacking:
    ``buf`` as a uint8 array, for `unpack_uint_range` chunk by chunk.

    Raises
    ------
    PayloadError
        If the buffer has the wrong length or non-zero padding bits.
    """
    raw = np.frombuffer(buf, dtype=np.uint8)
    nbits = count * width
    if raw.size != nbytes_for_bits(nbits):
        if width == 8:
            raise PayloadError(f"{what}: expected {count} bytes, got {raw.size}")
        raise PayloadError(f"{what}: expected {nbytes_for_bits(nbits)} bytes for {nbits} bits, got {raw.size}")
    pad = raw.size * 8 - nbits
    if pad and int(raw[-1]) >> (8 - pad):
        raise PayloadError(f"{what}: padding bits after bit {nbits} are not zero")
    return raw
