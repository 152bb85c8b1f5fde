"""Compressor base class, codec registry, ``get_compressor`` and ``decompress``."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch

from fedcomp.compression.chunked import join
from fedcomp.compression.errors import PayloadError
from fedcomp.compression.exact import EXACT_CODEC_ID, EXACT_NAME
from fedcomp.compression.options import Option
from fedcomp.compression.wire import DEFAULT_MAX_NUMEL, DTYPE_CODES, Header, pack_header, parse_header
from fedcomp.util.validate import check_number, closest_hint

#: name -> Compressor subclass
CODECS: dict[str, type[Compressor]] = {}
#: codec id -> Compressor subclass (used by ``decompress``)
_BY_ID: dict[int, type[Compressor]] = {}


def register(cls: type[Compressor]) -> type[Compressor]:
    """Class decorator: add a codec to the registry under ``cls.name`` and ``cls.codec_id`` (and set
    its ``config_keys`` from its ``options``).

    Raises
    ------
    ValueError
        If the name or id is already taken.
    """
    if cls.name in CODECS or cls.codec_id in _BY_ID:
        raise ValueError(f"codec {cls.name!r} / id {cls.codec_id} registered twice")
    cls.config_keys = {opt.arg: opt.key for opt in cls.options}
    CODECS[cls.name] = cls
    _BY_ID[cls.codec_id] = cls
    return cls


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

    A subclass sets ``name`` and ``codec_id``, implements :meth:`_encode` (float32 1-D
    tensor -> params bytes, body bytes) and the classmethod :meth:`_decode` (validated
    header fields and body -> float32 numpy array of n elements), and is decorated with
    :func:`register`. Codecs know nothing about Flower.
    """

    name: ClassVar[str] = ""
    codec_id: ClassVar[int] = -1
    #: The options the codec reads from a run config (:class:`~fedcomp.compression.options.Option`:
    #: constructor argument, run-config key, type, default, range). ``fedcomp.config.CodecConfig``
    #: builds its codec fields and each codec from these alone.
    options: ClassVar[tuple[Option, ...]] = ()
    #: Constructor argument -> run-config key, derived from :attr:`options` by :func:`register`.
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
    #: with error feedback (:mod:`fedcomp.config.low_density`).
    density_ramp: ClassVar[bool] = False
    #: Fit for ``small-tensor-compressor``: a dense cast, cheap on small tensors and never worse
    #: than its precision.
    small_tensor: ClassVar[bool] = False
    #: Non-empty if the codec only trains with error feedback: the reason, for the error message.
    requires_error_feedback: ClassVar[str] = ""

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
        """:meth:`compress` for a float32 ``x`` the caller has already proven finite (its norms are
        finite): the same payload without the finiteness pass of :func:`check_input`. Any other
        dtype, or a codec with a ``compress`` of its own, goes through :meth:`compress`."""
        if type(self).compress is not Compressor.compress or not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
            return self.compress(x)
        params, body = self._encode(x.detach().reshape(-1))
        return _assemble(pack_header(self.codec_id, x.dtype, tuple(x.shape), params), body)

    def _encode(self, flat: torch.Tensor) -> tuple[bytes, bytes | tuple]:  # pragma: no cover - abstract
        """``(params, body)``: the parameter block and the body, as bytes or as a tuple of bytes-like
        parts (contiguous numpy arrays included) that :meth:`compress` copies once into the payload."""
        raise NotImplementedError

    @classmethod
    def _decode(cls, header: Header, payload: memoryview) -> np.ndarray:
        """Validated header and payload -> float32 numpy array of ``header.numel`` entries.

        A codec overrides this or :meth:`_decode_into` (or both); this default decodes into a fresh
        array with :meth:`_decode_into`.
        """
        out = np.empty(header.numel, dtype=np.float32)
        cls._decode_into(header, payload, out)
        return out

    @classmethod
    def _decode_into(cls, header: Header, payload: memoryview, out: np.ndarray) -> None:
        """:meth:`_decode` into ``out`` (contiguous, ``header.numel`` entries, float32 or float64).

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

        :class:`~fedcomp.compression.ErrorFeedback` saves it with the residual.
        """
        return {}

    def set_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore what :meth:`get_state` returned (stateless codecs ignore it)."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({args})"


def _assemble(header: bytes, body: bytes | tuple) -> bytes:
    """The payload: ``header`` then the body (bytes, or a tuple of parts joined in one copy)."""
    return header + body if isinstance(body, bytes) else join(header, *body)


def get_compressor(name: str, **params) -> Compressor:
    """Build a registered codec by name.

    Parameters
    ----------
    name : str
        One of ``available_compressors()``: "none", "fp16", "bf16", "sign", "stc",
        "topk", "randomk", "qsgd", "int8", "powersgd", "eden".
    **params
        Codec parameters (``density``, ``levels``, ``block_size``, ``seed``,
        ``value_dtype``, ``rescale``, ``spacing``, ``rank``, ``unbiased``); see each
        codec's docstring.

    Returns
    -------
    Compressor

    Raises
    ------
    ValueError
        Unknown codec name; a parameter out of its range; a parameter the codec does not take:
        ``compressor 'stc' has no parameter 'densty'; did you mean 'density'? (its parameters: ['density'])``.
    """
    if name not in CODECS:
        raise ValueError(f"unknown compressor {name!r}; choose one of {sorted(CODECS)}")
    accepted = codec_parameters(name)
    for key in sorted(params):
        if key not in accepted and not accepted:
            raise ValueError(f"compressor {name!r} takes no parameters, got {key!r}")
        if key not in accepted:
            raise ValueError(f"compressor {name!r} has no parameter {key!r}; "
                             f"{closest_hint(key, accepted, 'parameter')} (its parameters: {sorted(accepted)})")
    return CODECS[name](**params)


def codec_parameters(name: str) -> frozenset[str]:
    """The keyword parameters the registered codec ``name`` takes (``frozenset()`` for "sign")."""
    signature = inspect.signature(CODECS[name])
    return frozenset(p.name for p in signature.parameters.values()
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def available_compressors() -> list[str]:
    """Names accepted by :func:`get_compressor`, sorted."""
    return sorted(CODECS)


def codec_name(payload: bytes) -> str:
    """Name of the codec that wrote ``payload`` (header only).

    Raises
    ------
    PayloadError
        Malformed header or unknown codec id.
    """
    header = parse_header(payload, max_numel=2**63)
    if header.codec_id == EXACT_CODEC_ID:
        return EXACT_NAME
    if header.codec_id not in _BY_ID:
        raise PayloadError(f"unknown codec id {header.codec_id}")
    return _BY_ID[header.codec_id].name


def _open(payload, max_numel: int, expected_shape) -> tuple:
    """``(payload, header, codec class or None)`` after the header checks shared by the decoders."""
    if isinstance(payload, memoryview) and not payload.c_contiguous:
        payload = payload.tobytes()
    header = parse_header(payload, max_numel=max_numel)
    if expected_shape is not None and tuple(header.shape) != tuple(expected_shape):
        raise PayloadError(f"payload shape {header.shape} does not match the expected {tuple(expected_shape)}")
    if header.codec_id == EXACT_CODEC_ID:
        raise PayloadError("an exact payload holds an integer/bool tensor: decode it with decode_exact, not decompress")
    cls = _BY_ID.get(header.codec_id)
    if cls is None:
        raise PayloadError(f"unknown codec id {header.codec_id}; known: { {c.codec_id: c.name for c in CODECS.values()} }")
    if header.exact_dtype is not None:  # float codecs encode float tensors only
        raise PayloadError(f"{cls.name} payload declares dtype {header.exact_dtype}; {cls.name} encodes "
                           "float16, bfloat16, float32 or float64 tensors only")
    return payload, header, cls


def decompress(
    payload: bytes | bytearray | memoryview,
    *,
    max_numel: int = DEFAULT_MAX_NUMEL,
    expected_shape: tuple[int, ...] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode any fedcomp payload; needs nothing but the payload.

    Parameters
    ----------
    payload : bytes-like
        Bytes produced by ``Compressor.compress`` (possibly from an untrusted peer).
    max_numel : int
        Refuse payloads that claim more elements than this (decompression-bomb guard),
        checked from the header before anything is allocated. Default 2**28.
    expected_shape : tuple of int, optional
        If given, the header's shape must equal it (checked before decoding the body).
    out : torch.Tensor, optional
        Decode into this caller's buffer instead of a fresh tensor (a server reusing one buffer
        for every reply saves the allocation and its page faults): a contiguous CPU tensor of
        ``numel`` entries (any shape), float32 (float64 for a ``none`` payload of a float64
        tensor). Checked against the header before the body is read. It may share memory with
        the payload (the payload's bytes are then copied before ``out`` is written). If decoding
        raises, its contents are unspecified.

    Returns
    -------
    torch.Tensor
        float32 CPU tensor of the original shape (float64 for a ``none`` payload of a float64
        tensor: such models stay float64 end to end); always finite. With ``out``: ``out`` itself,
        its shape unchanged.

    Raises
    ------
    PayloadError
        Truncated, bad magic, unknown codec or version, an exact payload, a header dtype the
        codec cannot produce (an integer dtype on a float codec), too many elements, shape other
        than ``expected_shape``, position out of range, non-finite scale or values,
        trailing bytes. Nothing is pickled or ``torch.load``-ed.
    TypeError
        ``out`` is not a torch tensor.
    ValueError
        ``out`` is not a contiguous float32/float64 CPU tensor of the payload's number of entries,
        or not of the dtype the payload decodes to.
    """
    payload, header, cls = _open(payload, max_numel, expected_shape)
    view = memoryview(payload).cast("B")
    if out is not None:
        flat = _out_array(out, header.numel)
        if flat.size and view.nbytes and np.may_share_memory(flat, np.frombuffer(view, dtype=np.uint8)):
            view = memoryview(view.tobytes())  # out overlaps the payload: decode from a copy of its bytes
        with np.errstate(over="ignore", invalid="ignore"):
            cls._decode_into(header, view, flat)
    else:
        with np.errstate(over="ignore", invalid="ignore"):  # overflow shows up as non-finite output, checked below
            flat = cls._decode(header, view)
    wide = flat.dtype == np.float64 and header.dtype == torch.float64  # only `none` of a float64 tensor
    if flat.shape != (header.numel,) or (flat.dtype != np.float32 and not wide):  # pragma: no cover - invariant
        raise PayloadError(f"{cls.name} decoder produced {flat.shape} {flat.dtype}")
    if not all_finite(flat):
        raise PayloadError(f"{cls.name} payload decodes to non-finite values")
    return out if out is not None else torch.from_numpy(flat).reshape(header.shape)


def _out_array(out, numel: int) -> np.ndarray:
    """``decompress``'s ``out`` as a flat numpy view, after the checks its docstring names."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"decompress: out must be a torch.Tensor, got {type(out).__name__}")
    if out.device.type != "cpu" or out.dtype not in (torch.float32, torch.float64) or not out.is_contiguous():
        raise ValueError(f"decompress: out must be a contiguous float32 or float64 CPU tensor, got {out.dtype} "
                         f"on {out.device}{'' if out.is_contiguous() else ' (not contiguous)'}")
    if out.numel() != numel:
        raise ValueError(f"decompress: out has {out.numel()} entries, the payload {numel}")
    return out.detach().numpy().reshape(-1)


def all_finite(a: np.ndarray) -> bool:
    """Whether every entry of a float array is finite: one summing pass (NaN and +-Inf propagate
    into the sum), and the elementwise check only when the sum is not finite (perhaps a mere
    overflow)."""
    if a.size == 0:
        return True
    if not a.flags.writeable:  # torch.from_numpy wants a writable array
        return bool(np.isfinite(a).all())
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(torch.from_numpy(a).sum().item()):
            return True
    return bool(np.isfinite(a).all())


def decompress_sparse(
    payload: bytes | bytearray | memoryview,
    *,
    max_numel: int = DEFAULT_MAX_NUMEL,
    expected_shape: tuple[int, ...] | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Decode a sparse payload (stc, topk, randomk) to its kept entries, without a dense output.

    Validation is :func:`decompress`'s. Used by the server to fold a sparse update into a
    running sum in O(k) (scatter-add of the kept entries).

    Parameters
    ----------
    payload : bytes-like
        Possibly untrusted bytes.
    max_numel, expected_shape
        As in :func:`decompress`.

    Returns
    -------
    (positions, values) or None
        ``positions``: int64, shape ``(k,)``, strictly increasing, each in ``[0, numel)`` of the
        flattened tensor; ``values``: float32, shape ``(k,)``, finite. None if the payload's codec
        is dense (sign, qsgd, int8, fp16, ...): decode it with :func:`decompress`. Memory is O(k)
        for every sparse codec (randomk regenerates its k positions without an n-sized mask when
        k <= n / 4).

    Raises
    ------
    PayloadError
        As :func:`decompress`: an unknown codec id, an exact (integer/bool) payload and a float
        codec's header that declares an integer dtype are refused, never answered with None.
    """
    payload, header, cls = _open(payload, max_numel, expected_shape)
    if not hasattr(cls, "_decode_sparse"):
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        pos, vals = cls._decode_sparse(header, memoryview(payload).cast("B"))
    pos = np.asarray(pos, dtype=np.int64)
    vals = np.asarray(vals, dtype=np.float32)
    if pos.shape != vals.shape or pos.ndim != 1:  # pragma: no cover - decoder invariant
        raise PayloadError(f"{cls.name} decoder produced {pos.shape} positions for {vals.shape} values")
    if len(pos) and (pos[0] < 0 or pos[-1] >= header.numel or (len(pos) > 1 and not bool((np.diff(pos) > 0).all()))):
        raise PayloadError(f"{cls.name} positions are not strictly increasing within [0, {header.numel})")
    if not np.isfinite(vals).all():
        raise PayloadError(f"{cls.name} payload decodes to non-finite values")
    return pos, vals


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
    """Validate a codec parameter (:func:`fedcomp.util.validate.check_number`: an ``int`` where
    ``integer``, finite, in ``[lo, hi]`` or ``(lo, hi]``); raise ``ValueError`` naming it and its range."""
    check_number(value, name, lo=lo, hi=hi, lo_open=lo_open, integer=integer, exact_type=True)
