"""``atomo``: unbiased atomic sparsification of the singular value decomposition of each update matrix.

Source: Wang, Sievert, Charles, Liu, Wright, Papailiopoulos, "ATOMO: Communication-efficient
Learning via Atomic Sparsification", NeurIPS 2018: Algorithm 1 (sample each atom independently
with probability p_i, send the kept ones scaled by 1/p_i) on the SVD atoms ``sigma_i u_i v_i^T``,
with the variance-minimising probabilities of their Section 3 (Algorithm 2) under a budget of
``s`` expected atoms.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from fedcomp.compression.base import Compressor, check_range
from fedcomp.compression.dense import SMALL_TENSOR, SMALL_TENSOR_CODECS
from fedcomp.compression.errors import PayloadError
from fedcomp.compression.options import Option
from fedcomp.compression.powersgd import MAX_RANK, check_low_rank_args, exact_product, matrix_shape
from fedcomp.compression.wire import BodyReader, Header, unpack_params


def atom_probabilities(sigma: torch.Tensor, budget: int) -> torch.Tensor:
    """ATOMO's variance-minimising sampling probabilities for atoms of weights ``sigma``.

    ``p_i = min(1, (s - j) * sigma_i / sum_{l not capped} sigma_l)``, where the j largest weights
    are capped at 1 (the smallest j for which the largest uncapped weight gets p <= 1): the
    minimiser of ``sum sigma_i^2 / p_i`` subject to ``sum p_i = s``, ``0 < p_i <= 1``. One
    cumulative sum gives every j at once.

    Parameters
    ----------
    sigma : torch.Tensor
        Non-negative weights (singular values), float32, shape ``(r,)``, in descending order.
    budget : int
        s >= 1, the expected number of atoms kept.

    Returns
    -------
    torch.Tensor
        float32, shape ``(r,)``, each in [0, 1], summing to ``min(s, number of non-zero sigma)``;
        1 for every non-zero weight when the budget covers them all; 0 where sigma is 0.
    """
    nonzero = int((sigma > 0).sum())
    if budget >= nonzero:
        return (sigma > 0).to(torch.float32)
    s = sigma.to(torch.float64)
    tail = torch.flip(torch.cumsum(torch.flip(s, (0,)), 0), (0,))  # tail[j] = sum_{l >= j} sigma_l
    j = torch.arange(len(s), dtype=torch.float64)
    fits = (budget - j) * s <= tail  # with j capped, the largest uncapped weight gets p <= 1
    first = int(torch.nonzero(fits)[0])  # exists: at j = budget - 1 it reads sigma_j <= tail[j]
    p = torch.clamp((budget - first) * s / tail[first], max=1.0)
    p[:first] = 1.0
    return p.to(torch.float32)


class AtomoCompressor(Compressor):
    """ATOMO on the SVD: the tensor viewed as a matrix M (m x n) ``= sum_i sigma_i u_i v_i^T`` is sent
    as the atoms a Bernoulli draw keeps, atom i with probability ``p_i`` (`atom_probabilities`,
    ``atoms`` of them expected), each as ``u_i`` (m), ``v_i`` (n) and ``w_i = sigma_i / p_i``; it
    decodes to ``sum_kept w_i u_i v_i^T``, whose expectation is M (unbiased; exact when ``atoms``
    is at least the rank of M, as every p_i is then 1).

    Conv weights ``[out, in, kh, kw]`` are viewed as ``[out, in*kh*kw]`` (as PowerSGD's). 0-d and
    1-D tensors, and matrices where ``r*(m+n+1) >= m*n / min_compression_rate`` (r = min(atoms, m,
    n)), go through the
    small-tensor codec ``fallback`` instead (its payload is that codec's; "none" is exact).

    The SVD runs in float32 on M divided by a power of two >= max |M| (exact), on ``x``'s device.
    The Bernoulli draw uses a ``torch.Generator`` seeded with ``seed``; the kept atoms travel
    themselves, so decoding needs no seed.

    Payload: parameters ``<I`` (k, the atoms sent), then body ``U`` (m x k), ``V`` (n x k) and
    ``w`` (k), little-endian float32: exactly ``4*k*(m+n+1) + 4`` bytes + header
    (``10 + 8*ndim``), k <= min(m, n) and ``E[k] = min(atoms, rank M)``.

    Parameters
    ----------
    atoms : int
        s >= 1, the expected number of atoms sent per matrix. Default 2.
    fallback : {"none", "fp16", "bf16"}
        Codec of the tensors where low rank does not pay. Default "none" (exact).
    min_compression_rate : float
        Atoms are sent only if ``atoms`` of them cost at most ``1 / min_compression_rate`` of the
        values (>= 1). Default 2 (as PowerSGD's).
    seed : int, optional
        Seed of the Bernoulli draw; None draws from the OS.
    """

    name = "atomo"
    codec_id = 11
    options = (Option("atomo-atoms", int, 2, "atomo: expected number of SVD atoms sent per matrix, s >= 1", lo=1,
                      hi=MAX_RANK, arg="atoms"), SMALL_TENSOR)
    seeded = True
    per_tensor_only = True
    _PARAMS = "<I"  # atoms sent

    def __init__(self, atoms: int = 2, fallback: str = "none", min_compression_rate: float = 2.0,
                 seed: int | None = None) -> None:
        check_range("atoms", atoms, 1, MAX_RANK, integer=True)
        check_low_rank_args(fallback, min_compression_rate, seed)
        self.atoms = int(atoms)
        self.fallback = fallback
        self.min_compression_rate = float(min_compression_rate)
        self._gen = torch.Generator()
        if seed is None:
            self._gen.seed()
        else:
            self._gen.manual_seed(seed)
        self._fallback = SMALL_TENSOR_CODECS[fallback]()
        self._mn = (0, 0)

    def config(self) -> dict:
        """``{"atoms": s, "fallback": ...}``."""
        return {"atoms": self.atoms, "fallback": self.fallback}

    def error_feedback_refusal(self) -> str:
        """Always non-empty: a matrix of rank r with a flat spectrum keeps each of its atoms with probability
        ``atoms / r``, for a variance of ``(r / atoms - 1) ||M||^2``; at or above ``||M||^2`` (r >= 2 atoms, every
        matrix that ATOMO compresses in practice) error feedback's residual grows without bound, and the residual
        itself is sampling noise with a flat spectrum. ATOMO is unbiased: the paper runs it without."""
        return (f"atomo (atoms={self.atoms}) is unbiased but its variance reaches (rank / atoms - 1) x ||x||^2 on a "
                f"matrix with a flat spectrum, and error feedback diverges from 1 x ||x||^2 on: only atoms at or above "
                f"every matrix's rank (where ATOMO sends it exactly) would bound it")

    def uses_atoms(self, shape: tuple[int, ...]) -> bool:
        """Whether a tensor of ``shape`` is sent as SVD atoms (else through ``fallback``)."""
        mn = matrix_shape(tuple(shape))
        if mn is None:
            return False
        m, n = mn
        r = min(self.atoms, m, n)
        return r >= 1 and r * (m + n + 1) * self.min_compression_rate < m * n

    def compress(self, x: torch.Tensor) -> bytes:
        """Compress ``x`` as sampled SVD atoms, or through ``fallback`` (see the class docstring).
        Raises ``ValueError`` for NaN/Inf or an unsupported dtype."""
        if not isinstance(x, torch.Tensor) or not self.uses_atoms(tuple(x.shape)):
            return self._fallback.compress(x)
        self._mn = matrix_shape(tuple(x.shape))
        return super().compress(x)

    def _encode(self, flat: torch.Tensor) -> tuple[bytes, bytes]:
        m, n = self._mn
        top = float(flat.abs().max())
        # a power of two (exact); at most 2**127, so that 1 / scale is a float32 (2**128 is not)
        scale = 2.0 ** min(math.ceil(math.log2(top)), 127) if top > 0 else 1.0
        u, sigma, vh = torch.linalg.svd(flat.view(m, n) / scale, full_matrices=False)
        p = atom_probabilities(sigma, self.atoms)
        draw = torch.rand(len(p), generator=self._gen).to(p.device)
        keep = torch.nonzero(draw < p).reshape(-1)  # p = 0 is never kept, p = 1 always
        w = (sigma[keep] / p[keep]).to(torch.float64) * scale
        if not bool(torch.isfinite(w).all()) or bool((w.abs() > np.finfo(np.float32).max).any()):
            raise ValueError(f"atomo: the input's magnitude (max |x| = {top:.3g}) is too large for float32 atom "
                             f"weights (sigma / p) of a {m} x {n} matrix; scale the update down or use another codec")
        body = b"".join(t.contiguous().cpu().numpy().astype(np.float32).tobytes()
                        for t in (u[:, keep], vh[keep].T, w))
        return struct.pack(self._PARAMS, len(keep)), body

    @classmethod
    def _decode(cls, header: Header, payload: memoryview) -> np.ndarray:
        (k,) = unpack_params(cls._PARAMS, header.params, cls.name)
        mn = matrix_shape(header.shape)
        if mn is None:
            raise PayloadError(f"atomo: shape {header.shape} is not a matrix (needs >= 2 dimensions)")
        m, n = mn
        if k > min(m, n):
            raise PayloadError(f"atomo: {k} atom(s) exceed min(m, n) = {min(m, n)} for a {m} x {n} matrix")
        rd = BodyReader(payload, header.body_offset, cls.name)
        u = np.frombuffer(rd.take(4 * m * k, "U"), dtype="<f4").reshape(m, k)
        v = np.frombuffer(rd.take(4 * n * k, "V"), dtype="<f4").reshape(n, k)
        w = np.frombuffer(rd.take(4 * k, "weights"), dtype="<f4")
        rd.finish()
        if not (np.isfinite(u).all() and np.isfinite(v).all() and np.isfinite(w).all()):
            raise PayloadError("atomo: U, V or the weights hold non-finite values")
        if k == 0:
            return np.zeros(m * n, dtype=np.float32)
        return exact_product(u * w, v.T).reshape(-1)
