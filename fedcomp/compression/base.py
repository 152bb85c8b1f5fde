"""The codec base class ([`Compressor`][fedcomp.compression.Compressor]) and the checks every codec shares: the input
check (`check_input`), parameter ranges (`check_range`), sparse decoding (`SparseDecoding`)
and the compression error. Which codecs exist is `fedcomp.compression.registry`'s; decoding any
payload is `fedcomp.compression.decoding`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch

from fedcomp.compression.chunked import join
from fedcomp.compression.options import Option
from fedcomp.compression.wire import DTYPE_CODES, Header, pack_header
from fedcomp.util.validate import check_number


def check_input(x: torch.Tensor) -> torch.Tensor:
    """Validate an input tensor and return it flattened as float32 on its own device.

    Parameters
    ----------
    x : torch.Tensor
        Any shape; dtype float16, bfloat16, float32 or float64; any device.

    Returns
    -------
    torch.Tensor
        1-D float32 view/copy, shape ``(x.numel(),)``, same device.

    Raises
    ------
    TypeError
        If ``x`` is not a tensor.
    ValueError
        If the dtype is unsupported or ``x`` holds NaN or Inf (checked before any selection).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in DTYPE_CODES:
        raise ValueError(f"unsupported dtype {x.dtype}; expected float16, bfloat16, float32 or float64")
    flat = x.detach().reshape(-1).to(torch.float32)
    # A finite sum proves every entry finite (NaN and +-Inf propagate); only a non-finite
    # sum (possibly a mere overflow) needs the full elementwise check.
    if flat.numel() and not bool(torch.isfinite(flat.sum())) and not bool(torch.isfinite(flat).all()):
        bad = int((~torch.isfinite(flat)).sum())
        if x.dtype == torch.float64 and bool(torch.isfinite(x).all()):
            raise ValueError(f"input holds {bad} float64 value(s) beyond the float32 range; refusing to compress")
        raise ValueError(f"input holds {bad} non-finite value(s) (NaN or Inf); refusing to compress")
    return flat


class Compressor:
    """Base class of every codec.

    A subclass sets ``name`` and ``codec_id``, implements `_encode` (float32 1-D
    tensor -> params bytes, body bytes) and the classmethod `_decode` (validated
    header fields and body -> float32 numpy array of n elements). A subclass defined in a module
    of this package is a registered codec (`fedcomp.compression.registry.discover`); one
    defined elsewhere registers with `fedcomp.compression.registry.register`. Codecs know
    nothing about Flower, nor about the registry.
    """

    name: ClassVar[str] = ""
    codec_id: ClassVar[int] = -1
    #: The options the codec reads from a run config (`Option`:
    #: constructor argument, run-config key, type, default, range). ``fedcomp.config.CodecConfig``
    #: builds its codec fields and each codec from these alone.
    options: ClassVar[tuple[Option, ...]] = ()
    #: Constructor argument -> run-config key, derived from `options` when the codec is registered.
    config_keys: ClassVar[dict[str, str]] = {}
    #: Whether the constructor takes ``seed`` (stochastic codecs; the client passes a per-round seed).
    seeded: ClassVar[bool] = False
    #: Sparse: the payload carries k chosen entries (their positions, or the seed that draws them;
    #: ``_decode_sparse``). With ``selection = "auto"`` such a codec picks its k over the whole
    #: model; DGC's momentum correction and ``batchnorm-affine = "small"`` apply to it.
    sparse: ClassVar[bool] = False
    #: Works per parameter tensor only (a low-rank codec): ``selection = "model"`` is refused.
    per_tensor_only: ClassVar[bool] = False
    #: One magnitude for the whole payload (sign): over a whole model's tensors, whose changes differ in
    #: size, it misfits every tensor, so the download sends such a codec per tensor by default.
    one_scale: ClassVar[bool] = False
    #: Usable under SecAgg+: clients' payloads add up entry-wise (no per-client positions or scales).
    secagg: ClassVar[bool] = False
    #: ``density-schedule = "auto"`` ramps its density down (DGC's warm-up) below density 1/400
    #: with error feedback (`fedcomp.config.low_density`).
    density_ramp: ClassVar[bool] = False
    #: Fit for ``small-tensor-compressor``: a dense cast, cheap on small tensors and never worse
    #: than its precision.
    small_tensor: ClassVar[bool] = False
    #: Non-empty if the codec only trains with error feedback: the reason, for the error message.
    requires_error_feedback: ClassVar[str] = ""

    def error_feedback_refusal(self) -> str:
        """Why error feedback would diverge with this codec and its options, or "" (it would not).

        Error feedback adds what a codec left out to the next input; that stays bounded only if the codec
        is a contraction, ``E||C(x) - x||^2 <= (1 - delta) ||x||^2`` for some ``delta > 0`` (Stich &
        Karimireddy, "The Error-Feedback Framework", 2020). Every biased codec here is one (it keeps part of
        ``x`` and drops the rest); an unbiased stochastic codec is one only where its worst-case variance
        ``E||C(x) - x||^2 / ||x||^2`` is below 1. `ErrorFeedback` raises ValueError with this reason followed by
        `WITHOUT_FEEDBACK`.
        """
        return ""

    @classmethod
    def kept_energy(cls, mag: torch.Tensor) -> torch.Tensor:
        """Squared L2 norm the codec keeps of a vector when it keeps its k largest entries, for every k.

        Parameters
        ----------
        mag : torch.Tensor
            |v| sorted in descending order, float64, shape ``(n,)``.

        Returns
        -------
        torch.Tensor
            float64, shape ``(n,)``: entry ``k-1`` is the energy kept with k entries; here top-k's
            ``sum_{i<=k} |v|_(i)^2`` (codecs that change the kept values override it).
        """
        return torch.cumsum(mag**2, 0)

    @classmethod
    def check_options(cls, values: Mapping[str, Any]) -> None:
        """Check combinations of the codec's run-config options (``values``: key -> value, already
        range-checked one by one); none by default.

        Raises
        ------
        ValueError
            A combination the codec cannot work with, naming the key (``"'levels' must be ..."``).
        """

    def compress(self, x: torch.Tensor) -> bytes:
        """Compress a tensor into a self-describing payload.

        Parameters
        ----------
        x : torch.Tensor
            Any shape, float16/bfloat16/float32/float64, CPU or CUDA. Arithmetic runs in
            float32 on ``x.device``; only the final bytes move to the CPU.

        Returns
        -------
        bytes
            Header plus body; ``len(payload)`` is exactly what travels.

        Raises
        ------
        ValueError
            Unsupported dtype, or NaN/Inf in ``x``.
        """
        flat = check_input(x)
        params, body = self._encode(flat)
        return _assemble(pack_header(self.codec_id, x.dtype, tuple(x.shape), params), body)

    def compress_finite(self, x: torch.Tensor) -> bytes:
        """[`compress`][fedcomp.compression.Compressor.compress] for a float32 ``x`` the caller has already proven
        finite (its norms are finite): the same payload without the finiteness pass of `check_input`. Any other
        dtype, or a codec with a ``compress`` of its own, goes through
        [`compress`][fedcomp.compression.Compressor.compress]."""
        if (type(self).compress is not Compressor.compress or not isinstance(x, torch.Tensor)
                or x.dtype != torch.float32):
            return self.compress(x)
        params, body = self._encode(x.detach().reshape(-1))
        return _assemble(pack_header(self.codec_id, x.dtype, tuple(x.shape), params), body)

    def _encode(self, flat: torch.Tensor) -> tuple[bytes, bytes | tuple]:  # pragma: no cover - abstract
        """``(params, body)``: the parameter block and the body, as bytes or as a tuple of bytes-like
        parts (contiguous numpy arrays included) that [`compress`][fedcomp.compression.Compressor.compress] copies once
        into the payload."""
        raise NotImplementedError

    @classmethod
    def _decode(cls, header: Header, payload: memoryview) -> np.ndarray:
        """Validated header and payload -> float32 numpy array of ``header.numel`` entries.

        A codec overrides this or `_decode_into` (or both); this default decodes into a fresh
        array with `_decode_into`.
        """
        out = np.empty(header.numel, dtype=np.float32)
        cls._decode_into(header, payload, out)
        return out

    @classmethod
    def _decode_into(cls, header: Header, payload: memoryview, out: np.ndarray) -> None:
        """`_decode` into ``out`` (contiguous, ``header.numel`` entries, float32 or float64).

        This default decodes a fresh array and copies it (the dtypes must match); codecs that can
        write straight into ``out`` override it. On a ``PayloadError`` the contents of ``out`` are
        unspecified.

        Raises
        ------
        ValueError
            ``out``'s dtype is not the decoded dtype.
        """
        flat = cls._decode(header, payload)
        if flat.dtype != out.dtype:
            raise ValueError(f"decompress: out is {out.dtype}, the {cls.name} payload decodes to {flat.dtype}")
        out[...] = flat

    def config(self) -> dict[str, float | int | str]:
        """Codec parameters as a flat dict (what ``get_compressor`` would take to rebuild it)."""
        return {}

    def get_state(self) -> dict[str, np.ndarray]:
        """Client-side memory the codec carries from one call to the next (e.g. PowerSGD's
        warm-start Q), as float numpy arrays by name; ``{}`` for stateless codecs.

        [`ErrorFeedback`][fedcomp.compression.ErrorFeedback] saves it with the residual.
        """
        return {}

    def set_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore what `get_state` returned (stateless codecs ignore it)."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({args})"


def _assemble(header: bytes, body: bytes | tuple) -> bytes:
    """The payload: ``header`` then the body (bytes, or a tuple of parts joined in one copy)."""
    return header + body if isinstance(body, bytes) else join(header, *body)


class SparseDecoding:
    """Mixin of sparse codecs: ``_decode`` scatters what ``_decode_sparse`` returns."""

    @classmethod
    def _decode(cls, header: Header, payload: memoryview) -> np.ndarray:
        pos, vals = cls._decode_sparse(header, payload)
        out = np.zeros(header.numel, dtype=np.float32)
        out[pos] = vals
        return out


def compression_error(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Relative L2 compression error ``||x - x_hat|| / ||x||`` (0.0 when x == 0 and x_hat == 0).

    Parameters
    ----------
    x, x_hat : torch.Tensor
        Same number of elements; compared in float64 on x's device.

    Returns
    -------
    float
        Dimensionless; ``inf`` if ``x`` is zero but ``x_hat`` is not.
    """
    a = x.detach().reshape(-1).to(torch.float64)
    b = x_hat.detach().reshape(-1).to(device=a.device, dtype=torch.float64)
    num = float(torch.linalg.vector_norm(a - b))
    den = float(torch.linalg.vector_norm(a))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def check_range(name: str, value, lo, hi, *, lo_open: bool = False, integer: bool = False) -> None:
    """Validate a codec parameter (`fedcomp.util.validate.check_number`: an ``int`` where
    ``integer``, finite, in ``[lo, hi]`` or ``(lo, hi]``); raise ``ValueError`` naming it and its range."""
    check_number(value, name, lo=lo, hi=hi, lo_open=lo_open, integer=integer, exact_type=True)
