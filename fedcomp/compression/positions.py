"""Golomb-Rice coding of sorted positions, shared by every sparse codec (stc, topk).

The gaps between consecutive kept positions of a density-p selection are close to
geometric(p). Golomb (1966) showed a Golomb code is optimal for geometric sources; with
a power-of-two divisor 2**b (a Rice code) it is within a fraction of a percent of the
entropy for small p. Sattler et al., "Robust and Communication-Efficient Federated
Learning from Non-IID Data", IEEE TNNLS 2019, choose

    b* = 1 + floor(log2(log(phi - 1) / log(1 - p))),   phi = (1 + sqrt 5) / 2,

which costs b* + 1 / (1 - (1 - p)**(2**b*)) bits per position. At p = 1/400 that is
10.11 bits against the information bound log2 C(n, k) / k = 10.09 bits (ratio 1.003);
at p = 0.01, 8.11 vs 8.08. The ratio stays under 1.03 for densities up to about 0.3;
above that, where gaps are mostly 0, it grows (a bitmap would be better there).

Stream layout: the k unary quotients (q zeros then a one) form one bit stream and the
k b-bit remainders a second, fixed-width stream. The code length is that of the
classic interleaved Rice code, but both directions vectorise with numpy: the
terminators are ``np.flatnonzero`` of the unary stream.

Decoding is bounded before anything is expanded: the quotients sum to at most
``(n - k) >> b`` (the gaps sum to at most n - k), so a valid unary stream has at most
``k + ((n - k) >> b)`` bits, and a header claiming more is refused from its fields alone
(`check_stream`). The stream is then decoded in chunks of `CHUNK_BITS` bits
(`iter_positions`), so a decoder scatters positions chunk by chunk and never holds
the k int64 positions at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from fedcomp.compression.bits import nbytes_for_bits, pack_bits, pack_uint, unpack_uint_range
from fedcomp.compression.errors import PayloadError

_PHI = (1.0 + math.sqrt(5.0)) / 2.0
#: Largest Rice parameter a payload may declare (positions are < 2**62).
MAX_RICE_PARAMETER = 62
#: Unary-stream bits decoded per step (at most this many positions per chunk).
CHUNK_BITS = 1 << 15


def rice_parameter(k: int, n: int) -> int:
    """Rice parameter b for k positions out of n (Sattler et al. 2019, eq. for b*).

    Parameters
    ----------
    k, n : int
        Kept entries and tensor size, ``0 <= k <= n``.

    Returns
    -------
    int
        b in ``[0, MAX_RICE_PARAMETER]``; 0 when ``k/n >= 0.5`` or ``k == 0``.
    """
    if k <= 0 or n <= 0:
        return 0
    p = k / n
    if p >= 0.5:
        return 0
    ratio = math.log(_PHI - 1.0) / math.log1p(-p)
    b = 1 + math.floor(math.log2(ratio))
    return int(min(max(b, 0), MAX_RICE_PARAMETER))


def information_bound_bits(k: int, n: int) -> float:
    """``log2 C(n, k)``: the fewest bits that can name a k-subset of n positions."""
    if k <= 0 or k >= n:
        return 0.0
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2.0)


def encode_positions(positions: np.ndarray, n: int) -> tuple[int, int, bytes]:
    """Rice-code strictly increasing positions.

    Parameters
    ----------
    positions : np.ndarray
        int64, shape ``(k,)``, strictly increasing, in ``[0, n)``.
    n : int
        Size of the index space.

    Returns
    -------
    (b, unary_bits, data)
        Rice parameter, number of bits in the unary stream, and the bytes:
        ``ceil(unary_bits/8)`` bytes of unary quotients then ``ceil(k*b/8)`` bytes of
        remainders.
    """
    k = int(positions.size)
    b = rice_parameter(k, n)
    if k == 0:
        return b, 0, b""
    pos = positions.astype(np.int64, copy=False)
    gaps = np.diff(pos, prepend=np.int64(-1)) - 1
    q = gaps >> b
    r = gaps & ((1 << b) - 1)
    terminators = np.cumsum(q + 1) - 1
    unary_bits = int(terminators[-1]) + 1
    stream = np.zeros(unary_bits, dtype=np.uint8)
    stream[terminators] = 1
    return b, unary_bits, pack_bits(stream) + pack_uint(r, b)


def positions_nbytes(k: int, b: int, unary_bits: int) -> int:
    """Byte length of the position block for the given header fields."""
    return nbytes_for_bits(unary_bits) + nbytes_for_bits(k * b)


def check_stream(k: int, n: int, b: int, unary_bits: int) -> None:
    """Validate a position block's header fields before any byte of it is read.

    Parameters
    ----------
    k, n : int
        Declared count and index-space size.
    b, unary_bits : int
        Rice parameter and declared unary stream length.

    Raises
    ------
    PayloadError
        ``k > n``, ``b`` above `MAX_RICE_PARAMETER`, a non-empty stream for k = 0, or a
        unary length outside ``[k, k + ((n - k) >> b)]`` (the most a valid stream can need).
    """
    if k > n:
        raise PayloadError(f"positions: k = {k} exceeds the tensor size {n}")
    if b > MAX_RICE_PARAMETER:
        raise PayloadError(f"Rice parameter {b} exceeds {MAX_RICE_PARAMETER}")
    if k == 0:
        if unary_bits != 0:
            raise PayloadError("positions: k = 0 but the position stream is not empty")
        return
    if unary_bits < k:
        raise PayloadError(f"positions: unary stream of {unary_bits} bits cannot hold {k} quotients")
    most = k + ((n - k) >> b)
    if unary_bits > most:
        raise PayloadError(f"positions: unary stream of {unary_bits} bits exceeds the {most} bits that {k} positions "
                           f"in [0, {n}) need at most with Rice parameter {b} (k + ((n - k) >> b))")


def iter_positions(data: memoryview | bytes, k: int, n: int, b: int,
                   unary_bits: int) -> Iterator[tuple[int, np.ndarray]]:
    """Decode and validate positions written by `encode_positions`, chunk by chunk.

    Header fields and byte counts are checked when this is called; the chunks are checked as
    they are produced, so a malformed stream raises from the iteration (the caller discards
    what it built).

    Parameters
    ----------
    data : bytes-like
        Exactly ``positions_nbytes(k, b, unary_bits)`` bytes.
    k, n : int
        Declared count and index-space size.
    b, unary_bits : int
        Rice parameter and unary stream length from the payload's parameters.

    Returns
    -------
    iterator of (first, positions)
        ``positions``: int64, strictly increasing, in ``[0, n)``, at most `CHUNK_BITS`
        of them; ``first``: the index of its first entry among the k. Together: k positions.

    Raises
    ------
    PayloadError
        The header bounds of `check_stream`, a wrong byte count, padding bits set, a
        wrong number of terminators, a gap past n or a position out of range.
    """
    check_stream(k, n, b, unary_bits)
    ub = nbytes_for_bits(unary_bits)
    rb = nbytes_for_bits(k * b)
    raw = np.frombuffer(data, dtype=np.uint8)
    if raw.size != ub + rb:
        raise PayloadError("positions: byte length does not match the declared stream lengths")
    for what, end, nbits in (("unary stream", ub, unary_bits), ("remainders", ub + rb, k * b)):
        pad = nbytes_for_bits(nbits) * 8 - nbits
        if pad and int(raw[end - 1]) >> (8 - pad):
            raise PayloadError(f"positions ({what}): padding bits after bit {nbits} are not zero")
    return _chunks(raw[:ub], raw[ub:], k, n, b, unary_bits)


def _chunks(unary: np.ndarray, rem: np.ndarray, k: int, n: int, b: int, unary_bits: int):
    done, last_term, last_pos = 0, -1, -1
    step = CHUNK_BITS // 8
    for start in range(0, unary.size, step):
        t = np.flatnonzero(np.unpackbits(unary[start : start + step], bitorder="little"))
        if t.size == 0:
            continue
        if done + t.size > k:
            raise PayloadError(f"positions: unary stream holds more than the declared {k} codes")
        t += 8 * start
        q = np.diff(t, prepend=np.int64(last_term)) - 1
        last_term = int(t[-1])
        # q <= unary_bits, so q << b overflows int64 only if the gap could not be < n anyway.
        if (int(q.max()) << b) >= n:
            raise PayloadError(f"positions: a gap exceeds the tensor size {n}")
        gaps = np.left_shift(q, b, out=q)
        if b:
            gaps |= unpack_uint_range(rem, done, t.size, b).astype(np.int64)
        gaps += 1
        pos = np.cumsum(gaps, out=gaps)
        pos += last_pos
        # Each step adds at most n + 2**b <= 2**63, so an int64 wrap shows as a decrease.
        if int(pos[0]) <= last_pos or int(pos[-1]) >= n or (pos.size > 1 and bool(np.any(np.diff(pos) <= 0))):
            raise PayloadError(f"positions: position out of range [0, {n})")
        yield done, pos
        done += pos.size
        last_pos = int(pos[-1])
    if done != k or last_term != unary_bits - 1:
        raise PayloadError(
            f"positions: unary stream holds {done} codes ending at bit {last_term + 1}, "
            f"expected {k} ending at {unary_bits}"
        )


def decode_positions(data: memoryview | bytes, k: int, n: int, b: int, unary_bits: int) -> np.ndarray:
    """All k positions at once (`iter_positions`, concatenated).

    Returns
    -------
    np.ndarray
        int64, shape ``(k,)``, strictly increasing, every entry in ``[0, n)``.

    Raises
    ------
    PayloadError
        As `iter_positions`.
    """
    parts = [pos for _, pos in iter_positions(data, k, n, b, unary_bits)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
