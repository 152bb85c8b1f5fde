"""``powersgd``: rank-r approximation by one warm-started power iteration per round.

Source: Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019, Algorithm 1 (and its error feedback, Algorithm 2).
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from fedcomp.compression.base import Compressor, check_range
from fedcomp.compression.dense import SMALL_TENSOR, SMALL_TENSOR_CODECS
from fedcomp.compression.errors import PayloadError
from fedcomp.compression.options import VALUE_DTYPE, Option
from fedcomp.compression.wire import VALUE_DTYPE_BY_CODE, VALUE_DTYPES, BodyReader, Header, unpack_params

MAX_RANK = 2**16 - 1
#: Fallback codecs for tensors where low rank does not pay (the small-tensor codecs).
FALLBACKS = tuple(SMALL_TENSOR_CODECS)


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The matrix a tensor is viewed as: ``(shape[0], prod(shape[1:]))`` (a conv weight
    ``[out, in, kh, kw]`` becomes ``[out, in*kh*kw]``); None for 0-d and 1-D tensors."""
    if len(shape) < 2:
        return None
    return int(shape[0]), math.prod(shape[1:])


def low_rank_pays(m: int, n: int, rank: int, min_compression_rate: float) -> bool:
    """True if rank ``min(rank, m, n)`` factors cost less than ``m*n / min_compression_rate`` values,
    i.e. unless ``r*(m+n) >= m*n / min_compression_rate``."""
    r = min(rank, m, n)
    return r >= 1 and r * (m + n) * min_compression_rate < m * n


def check_low_rank_args(fallback: str, min_compression_rate: float, seed: int | None) -> None:
    """Check the arguments the low-rank codecs share (``fallback`` one of `FALLBACKS`,
    ``min_compression_rate`` >= 1, ``seed`` None or in [0, 2**63)); raise ``ValueError`` naming one."""
    check_range("min_compression_rate", min_compression_rate, 1.0, float("inf"))
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {list(FALLBACKS)}, got {fallback!r}")
    if seed is not None:
        check_range("seed", seed, 0, 2**63 - 1, integer=True)


#: Float64 entries of one block of rows of `exact_product` (512 KiB).
PRODUCT_BLOCK = 1 << 16


def exact_product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` of a low-rank pair as float32, each entry the float64 product rounded once.

    A float32 matrix product sums in whatever order the BLAS kernel of the CPU chooses, so two CPU
    types can decode one payload to different last bits; a node's copy of a compressed download must
    equal the server's record bit for bit (its digest is compared). The products of float32 factors are
    exact in float64 and their sum over a small rank differs between orders far below float32's
    precision, so the rounded result is the same whatever the BLAS. Computed in blocks of rows, so the
    float64 scratch stays below `PRODUCT_BLOCK` entries.

    Parameters
    ----------
    a : np.ndarray
        ``(m, r)``, float32.
    b : np.ndarray
        ``(r, n)``, float32.

    Returns
    -------
    np.ndarray
        ``(m, n)`` float32.
    """
    m, n = a.shape[0], b.shape[1]
    out = np.empty((m, n), dtype=np.float32)
    wide_b = b.astype(np.float64)
    rows = max(1, PRODUCT_BLOCK // max(n, 1))
    for i in range(0, m, rows):
        out[i: i + rows] = a[i: i + rows].astype(np.float64) @ wide_b
    return out


def orthogonalize(p: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Orthonormalise the columns of ``p`` in place by a Householder QR (``torch.linalg.qr``).

    The paper orthogonalises by Gram-Schmidt; with an epsilon in each division, a linearly
    dependent column (a rank-deficient M, e.g. the rank-1 gradient of one example) becomes an
    amplified rounding-noise direction with a large component along the earlier columns, and a
    rank-1 matrix at rank 2 decodes with relative error 0.61. Householder QR
    returns columns orthonormal to working precision whatever the rank of ``p``: a dependent
    column becomes some unit direction orthogonal to the others, on which M^T P then has (almost)
    nothing, so ``P Q^T = P P^T M`` stays a projection of M and a rank-d matrix is recovered
    exactly at every rank ``r >= d``. Columns are signed so that R has a non-negative diagonal,
    which makes the result equal to Gram-Schmidt's wherever ``p`` has full column rank.

    Parameters
    ----------
    p : torch.Tensor
        float32, shape ``(m, r)`` with ``m >= r``; overwritten.
    eps : float
        Kept for callers of the Gram-Schmidt version; unused (QR needs no epsilon: a zero ``p``
        gives orthonormal columns, never NaN).

    Returns
    -------
    torch.Tensor
        ``p`` itself, with ``p.T @ p == I`` to float32 precision.
    """
    q, r = torch.linalg.qr(p, mode="reduced")
    sign = torch.where(torch.diagonal(r) < 0, -1.0, 1.0).to(q.dtype)
    p.copy_(q * sign)
    return p


def pow2_scale(t: torch.Tensor) -> float:
    """A power of two >= max |t| (1.0 for a zero tensor): dividing by it is exact."""
    top = float(t.abs().max()) if t.numel() else 0.0
    return 2.0 ** math.ceil(math.log2(top)) if top > 0 else 1.0


class PowerSGDCompressor(Compressor):
    """Rank-r PowerSGD: the tensor viewed as a matrix M (m x n) is sent as ``P (m x r)`` and
    ``Q (n x r)``; it decodes to ``P Q^T``.

    One power iteration per call (Algorithm 1): ``P = M Q_prev``, ``P <- orthogonalize(P)``
    (a Householder QR in place of the paper's Gram-Schmidt: a zero or rank-deficient M decodes
    to finite values, and a matrix of rank d <= r is recovered exactly), ``Q = M^T P``. Warm start: the Q of one
    call starts the next (kept on this object and saved/restored through `get_state`/`set_state`, which
    [`ErrorFeedback`][fedcomp.compression.ErrorFeedback] persists with the residual); the first Q, and
    any Q whose shape no longer fits, is drawn from a seeded standard normal. M is divided by a
    power of two >= max |M| before the iteration (exact), so no fp32 product overflows.

    The codec is biased: use it with error feedback on M (``e <- M - P Q^T``), as the paper
    does. The federated server averages the decoded ``P_i Q_i^T`` of its clients (not P and Q
    as the paper's all-reduce does), so each client's rank-r approximation stands alone.

    Tensors for which low rank does not pay go through the small-tensor codec ``fallback``
    instead, and their payload is that codec's: 0-d and 1-D tensors, and every matrix with
    ``r*(m+n) >= m*n / min_compression_rate`` (r = min(rank, m, n)).

    Size: exactly ``r*(m+n)*b`` bytes (b = 4 for fp32, 2 for fp16 values) + 5 bytes of
    parameters + header; a 64 x 576 conv weight at rank 4 costs 2.2 bits/parameter.

    Parameters
    ----------
    rank : int
        r >= 1. Default 4 (the paper's experiments use ranks 1-4).
    value_dtype : {"fp32", "fp16"}
        Wire type of P and Q. Default "fp32"; "fp16" halves the size and saturates at ±65504.
    fallback : {"none", "fp16", "bf16"}
        Codec of the tensors where low rank does not pay. Default "none" (exact).
    min_compression_rate : float
        Low rank is used only if it sends at most ``1 / min_compression_rate`` of the values
        (>= 1). Default 2 (as PyTorch's PowerSGD hook).
    seed : int, optional
        Seed of the first Q; None draws from the OS.

    Attributes
    ----------
    q : torch.Tensor or None
        The warm-start Q (float32, ``(n, r)``), None before the first low-rank call.
    """

    name = "powersgd"
    codec_id = 9
    options = (Option("rank", int, 4, "rank r >= 1", lo=1, hi=MAX_RANK, arg="rank"), VALUE_DTYPE, SMALL_TENSOR)
    seeded = True
    per_tensor_only = True
    requires_error_feedback = "PowerSGD is biased and keeps its warm-start Q with the residual; Vogels et al. 2019"
    _PARAMS = "<IB"  # rank, value dtype code

    def __init__(self, rank: int = 4, value_dtype: str = "fp32", fallback: str = "none",
                 min_compression_rate: float = 2.0, seed: int | None = None) -> None:
        check_range("rank", rank, 1, MAX_RANK, integer=True)
        if value_dtype not in VALUE_DTYPES:
            raise ValueError(f"value_dtype must be one of {sorted(VALUE_DTYPES)}, got {value_dtype!r}")
        check_low_rank_args(fallback, min_compression_rate, seed)
        self.rank = int(rank)
        self.value_dtype = value_dtype
        self.fallback = fallback
        self.min_compression_rate = float(min_compression_rate)
        self.seed = seed
        self.q: torch.Tensor | None = None
        self._fallback = SMALL_TENSOR_CODECS[fallback]()
        self._mn = (0, 0)

    def config(self) -> dict:
        """``{"rank": r, "value_dtype": ..., "fallback": ...}``."""
        return {"rank": self.rank, "value_dtype": self.value_dtype, "fallback": self.fallback}

    def get_state(self) -> dict[str, np.ndarray]:
        """``{"q": Q}`` (float32, ``(n, r)``) once a low-rank call has run, else ``{}``."""
        return {} if self.q is None else {"q": self.q.detach().cpu().numpy().copy()}

    def set_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore the warm-start Q saved by `get_state` (``{}`` forgets it).

        Raises
        ------
        ValueError
            Q is not a finite 2-D float array.
        """
        q = state.get("q")
        if q is None:
            self.q = None
            return
        t = torch.as_tensor(np.asarray(q))
        if t.ndim != 2 or not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise ValueError("powersgd: saved Q must be a finite 2-D float array")
        self.q = t.to(torch.float32).clone()

    def uses_low_rank(self, shape: tuple[int, ...]) -> bool:
        """Whether a tensor of ``shape`` is sent as P and Q (else through ``fallback``)."""
        mn = matrix_shape(tuple(shape))
        return mn is not None and low_rank_pays(*mn, self.rank, self.min_compression_rate)

    def compress(self, x: torch.Tensor) -> bytes:
        """Compress ``x`` as P and Q, or through ``fallback`` where low rank does not pay
        (see the class docstring). Raises ``ValueError`` for NaN/Inf or an unsupported dtype."""
        if not isinstance(x, torch.Tensor) or not self.uses_low_rank(tuple(x.shape)):
            return self._fallback.compress(x)
        self._mn = matrix_shape(tuple(x.shape))
        return super().compress(x)

    def _start_q(self, n: int, r: int, device: torch.device) -> torch.Tensor:
        if self.q is not None and tuple(self.q.shape) == (n, r):
            q = self.q.to(device=device, dtype=torch.float32)
            return q / pow2_scale(q)  # exact; P's direction does not change
        gen = torch.Generator()
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return torch.randn(n, r, generator=gen).to(device)

    def _encode(self, flat: torch.Tensor) -> tuple[bytes, bytes]:
        m, n = self._mn
        r = min(self.rank, m, n)
        code, np_dt, _ = VALUE_DTYPES[self.value_dtype]
        scale = pow2_scale(flat)
        mat = flat.view(m, n) / scale
        p = orthogonalize(mat @ self._start_q(n, r, flat.device))
        q = (mat.T @ p) * scale
        if not bool(torch.isfinite(q).all()):  # pragma: no cover - needs |M| near the fp32 maximum
            raise ValueError("powersgd: Q = M^T P overflows float32")
        self.q = q
        if np_dt is np.float16:
            p, q = p.to(torch.float16), q.clamp(-65504.0, 65504.0).to(torch.float16)
        body = p.contiguous().cpu().numpy().tobytes() + q.contiguous().cpu().numpy().tobytes()
        return struct.pack(self._PARAMS, r, code), body

    @classmethod
    def _decode(cls, header: Header, payload: memoryview) -> np.ndarray:
        r, code = unpack_params(cls._PARAMS, header.params, cls.name)
        mn = matrix_shape(header.shape)
        if mn is None:
            raise PayloadError(f"powersgd: shape {header.shape} is not a matrix (needs >= 2 dimensions)")
        m, n = mn
        if not 1 <= r <= min(m, n):
            raise PayloadError(f"powersgd: rank {r} outside [1, min(m, n) = {min(m, n)}] for a {m} x {n} matrix")
        if code not in VALUE_DTYPE_BY_CODE:
            raise PayloadError(f"powersgd: unknown value dtype code {code}")
        _, np_dt, size = VALUE_DTYPE_BY_CODE[code]
        rd = BodyReader(payload, header.body_offset, cls.name)
        p = np.frombuffer(rd.take(m * r * size, "P"), dtype=np_dt).reshape(m, r).astype(np.float32)
        q = np.frombuffer(rd.take(n * r * size, "Q"), dtype=np_dt).reshape(n, r).astype(np.float32)
        rd.finish()
        if not (np.isfinite(p).all() and np.isfinite(q).all()):
            raise PayloadError("powersgd: P or Q holds non-finite values")
        return exact_product(p, q.T).reshape(-1)
