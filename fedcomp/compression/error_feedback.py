"""Error feedback (residual memory) around any compressor, and the rest of a client's codec
state: DGC's momentum correction and the codec's own memory (PowerSGD's warm-start Q).

Sources: Seide et al., "1-Bit Stochastic Gradient Descent", Interspeech 2014; Stich,
Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS 2018; Karimireddy et al.,
"Error Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML 2019; Lin, Han,
Mao, Wang, Dally, "Deep Gradient Compression", ICLR 2018 (momentum correction and momentum
factor masking).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from fedcomp.compression.base import Compressor, check_input, check_range
from fedcomp.compression.decoding import decompress, decompress_sparse

_RESIDUAL_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}

#: Keys of `ErrorFeedback.get_state` besides the codec's own ("<codec name>/<key>").
RESIDUAL, MOMENTUM = "residual", "momentum"
#: What a refusal of error feedback (`Compressor.error_feedback_refusal`) adds where error feedback is a setting.
WITHOUT_FEEDBACK = "or turn error feedback off (the codec is unbiased: it trains without it)"


def check_error_feedback(compressor: Compressor, setting: str) -> None:
    """Refuse error feedback with a codec with which it diverges (`Compressor.error_feedback_refusal`).

    Raises
    ------
    ValueError
        ``"<setting>: <the codec's reason>; or turn error feedback off (...)"``.
    """
    if refusal := compressor.error_feedback_refusal():
        raise ValueError(f"{setting}: {refusal}; {WITHOUT_FEEDBACK}")


def error_feedback_default(compressor: Compressor) -> bool:
    """Whether error feedback is on when the caller leaves it unset: for every lossy codec (not the dense casts
    ``none``/``fp16``/``bf16``, which then match a plain exchange) with which it converges."""
    return not compressor.small_tensor and not compressor.error_feedback_refusal()
#: Separator between a payload key and a state entry name in `flatten_states`.
STATE_SEP = "#"


def segment_sq_norms(flat: torch.Tensor, sizes: list[int]) -> list[float]:
    """Squared L2 norms of consecutive segments of a float32 vector (fp32 reduction, float results)."""
    out, off = [], 0
    for n in sizes:
        out.append(float(torch.linalg.vector_norm(flat[off: off + n])) ** 2 if n else 0.0)
        off += n
    return out


def encode_and_subtract(compressor: Compressor, v: torch.Tensor, segments: list[int] | None = None, *,
                        sent: bool = False, sq_norms: list[float] | None = None, finite: bool = False,
                        ) -> tuple[bytes, list[float], list[float], torch.Tensor | None]:
    """Compress ``v`` and overwrite it with the compression error ``v - decompress(payload)``.

    The one place that turns a payload back into what the receiver sees and subtracts it: used by
    [`ErrorFeedback.compress`][fedcomp.compression.ErrorFeedback.compress] (the error becomes the residual) and by a
    client without error feedback (the error only feeds its statistics).

    Parameters
    ----------
    compressor : Compressor
        Any codec.
    v : torch.Tensor
        float32, any shape and device, finite; overwritten in place with the error.
    segments : list of int, optional
        Sizes of consecutive segments of the flattened ``v`` (summing to ``v.numel()``); default
        one segment.
    sent : bool
        Also return the flat positions the decoded payload makes non-zero (DGC's momentum masking).
    sq_norms : list of float, optional
        The segments' squared norms of ``v`` when the caller has them already (one pass fewer).
    finite : bool
        The caller has proven ``v`` finite (float32): the codec skips its own finiteness pass
        (`Compressor.compress_finite`; the same payload).

    Returns
    -------
    (payload, sq_norms, sq_errors, positions)
        The payload; per segment ``||v||**2`` before and ``||v - v_hat||**2`` after (fp32
        reductions, Python floats); int64 positions of the non-zero decoded entries (on
        ``v.device``) when ``sent``, else None.

    Raises
    ------
    ValueError
        From the codec: NaN/Inf in ``v`` (``v`` is then unchanged).
    """
    # A strided v (a transposed or channels_last tensor) has no flat view: work on a row-major copy
    # and write the error back, so that the in-place subtraction reaches v.
    work = v if v.is_contiguous() else v.contiguous()
    flat = work.view(-1)
    sizes = [flat.numel()] if segments is None else list(segments)
    norms = segment_sq_norms(flat, sizes) if sq_norms is None else sq_norms
    payload = compressor.compress_finite(work) if finite else compressor.compress(work)
    # The error v - v_hat, in place: O(k) for sparse payloads, one decode otherwise.
    sparse = decompress_sparse(payload, max_numel=max(v.numel(), 1))
    positions = None
    if sparse is not None:
        pos, vals = (torch.from_numpy(a).to(v.device) for a in sparse)
        flat[pos] -= vals
        positions = pos[vals != 0] if sent else None
    else:
        v_hat = decompress(payload, max_numel=max(v.numel(), 1)).to(v.device).reshape(-1)
        flat -= v_hat
        positions = torch.nonzero(v_hat).reshape(-1) if sent else None
        del v_hat
    if work is not v:
        v.copy_(work)
    return payload, norms, segment_sq_norms(flat, sizes), positions


class ErrorFeedback:
    """Compress ``x + e`` and keep what was lost: ``e <- (x + e) - decompress(sent)``.

    Over any sequence of calls the sends telescope: ``sum(decoded sends) + e_final ==
    sum(inputs)`` up to float32 rounding (exactly so with an fp32 residual, up to fp16
    rounding of e with ``residual_dtype="fp16"``). The residual is computed from the
    *decoded payload*, i.e. exactly what the receiver sees.

    Momentum correction (DGC, Lin et al. 2018, Sec. 3.2, with the client's round update in
    place of a gradient): with ``momentum = beta > 0`` each call runs
    ``u <- beta * u + x; v <- e + u; send C(v); e <- v - decompress(C(v))`` and then momentum
    factor masking, ``u <- 0`` where the decoded send is non-zero. For top-k and rand-k this is
    DGC exactly (``e`` is DGC's v, zeroed where sent); for STC, ``e`` keeps the ternarisation
    error at sent entries (the error-feedback rule) instead of zeroing it. The telescoping then
    reads ``sum(decoded sends) + e_final == sum(u before masking)``. With a codec that sends
    every entry, u is zeroed every call and this is plain error feedback.

    The whole client-side state (residual, momentum buffer, and the codec's own memory such as
    PowerSGD's warm-start Q) is saved and restored with [`get_state`][fedcomp.compression.ErrorFeedback.get_state] /
    [`set_state`][fedcomp.compression.ErrorFeedback.set_state].

    Parameters
    ----------
    compressor : Compressor
        Any codec from [`fedcomp.compression.get_compressor`][].
    residual_dtype : {"fp32", "fp16"}
        Storage of the residual (and of the momentum buffer); "fp16" halves its memory
        (4 -> 2 bytes/parameter) and saturates entries beyond ±65504.
    momentum : float
        DGC's momentum-correction factor beta in [0, 1); 0 (default) turns it off.

    Raises
    ------
    ValueError
        A bad ``residual_dtype`` or ``momentum``, or a codec with which error feedback diverges
        ([`Compressor.error_feedback_refusal`][fedcomp.compression.Compressor.error_feedback_refusal]: QSGD with
        too few levels for its bucket size).

    Attributes
    ----------
    residual : torch.Tensor or None
        Current residual, shape of the last input, on its device; None before the first call.
    momentum_buffer : torch.Tensor or None
        DGC's u after masking (None unless ``momentum > 0`` and a call ran).
    last_error : float
        Relative L2 compression error ``||v - v_hat|| / ||v||`` of the last call (v = x + e).
    last_saturated : int
        Residual entries the last call clamped to ±65504 (``residual_dtype="fp16"``; else 0).
    last_saturated_loss : float
        What the clamp dropped in the last call, ``||max(|e| - 65504, 0)|| / ||v||`` (relative
        L2, like ``last_error``; 0.0 when nothing saturated): lost for good, never sent later.
    """

    def __init__(self, compressor: Compressor, residual_dtype: str = "fp32", momentum: float = 0.0) -> None:
        if not isinstance(compressor, Compressor):
            raise TypeError(f"expected a Compressor, got {type(compressor).__name__}")
        if residual_dtype not in _RESIDUAL_DTYPES:
            raise ValueError(f"residual_dtype must be one of {sorted(_RESIDUAL_DTYPES)}, got {residual_dtype!r}")
        check_range("momentum", momentum, 0.0, 1.0)
        if momentum >= 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        check_error_feedback(compressor, "error feedback")
        self.compressor = compressor
        self.residual_dtype = residual_dtype
        self.momentum = float(momentum)
        self.momentum_buffer: torch.Tensor | None = None
        self.residual: torch.Tensor | None = None
        self.last_error = 0.0
        self.last_sq_error = 0.0
        self.last_sq_norm = 0.0
        self.last_segment_sq_norms: list[float] = []
        self.last_segment_sq_errors: list[float] = []
        self.last_saturated, self.last_saturated_loss = 0, 0.0

    def compress(self, x: torch.Tensor, *, inplace: bool = False, segments: list[int] | None = None,
                 finite: bool = False) -> bytes:
        """Compress ``x`` plus the residual and update the residual.

        Parameters
        ----------
        x : torch.Tensor
            Any shape and supported float dtype; CPU or CUDA. Must keep the same shape
            across calls (call [`reset`][fedcomp.compression.ErrorFeedback.reset] to change it).
        inplace : bool
            Allow overwriting a float32 ``x``: it becomes ``v = x + e`` and then the new
            residual, so the call needs no model-sized copy of its own (not once a momentum
            buffer exists: momentum correction keeps ``x`` untouched). Default False.
        segments : list of int, optional
            Sizes of consecutive segments of the flattened ``x`` (summing to ``x.numel()``);
            their squared norms of ``v`` and of the error are then kept in
            `last_segment_sq_norms` / `last_segment_sq_errors` (per-layer
            monitoring without another pass by the caller).
        finite : bool
            The caller has proven ``x`` a finite float32 tensor (its norms are finite): its
            check is not repeated here.

        Returns
        -------
        bytes
            The payload of ``x + e``.

        Raises
        ------
        ValueError
            NaN/Inf in ``x`` or a shape different from the residual's (or the momentum
            buffer's); the state is left unchanged.
        """
        if not finite:
            check_input(x)
        if self.residual is not None and self.residual.shape != x.shape:
            raise ValueError(f"input shape {tuple(x.shape)} differs from the residual's {tuple(self.residual.shape)}")
        mom = self.momentum_buffer if self.momentum > 0 else None
        if mom is not None and mom.shape != x.shape:
            raise ValueError(f"input shape {tuple(x.shape)} differs from the momentum buffer's {tuple(mom.shape)}")
        v = x.detach()
        shared = v.dtype == torch.float32 and inplace and mom is None and v.is_contiguous()  # v is x itself
        if not shared:  # row-major whatever x's strides: the residual and the momentum buffer are viewed flat
            v = v.to(torch.float32, copy=True, memory_format=torch.contiguous_format)
        if mom is not None:  # DGC: u <- beta * u + x
            v.add_(mom.to(device=v.device, dtype=torch.float32), alpha=self.momentum)
        u = v.clone() if self.momentum > 0 else None
        norms = None
        if self.residual is not None:
            v += self.residual.to(device=v.device)  # fp16 added in place, promoted per entry: no fp32 copy
            # The norms of v are needed anyway; finite norms prove every entry finite (no pass of its own).
            norms = segment_sq_norms(v.reshape(-1), [v.numel()] if segments is None else list(segments))
            if not math.isfinite(sum(norms)) and not bool(torch.isfinite(v).all()):
                if shared:
                    v -= self.residual.to(device=v.device)  # give x back as it was
                raise ValueError("input + residual overflows float32; residual left unchanged")
        return self._send(v, u, norms, segments)

    def compress_summed(self, v: torch.Tensor, sq_norms: list[float], *, segments: list[int] | None = None) -> bytes:
        """Compress ``v = x + e``, which the caller has formed already, and keep its error as the residual.

        For `fedcomp.compression.feedback_pass.feedback_pass`, which writes the update and adds
        the residual in one pass of its own and checks the sum: the result, payload and new state are
        those of [`compress`][fedcomp.compression.ErrorFeedback.compress] on ``x`` with the residual ``e`` this object
        would have held, bit for bit.

        Parameters
        ----------
        v : torch.Tensor
            float32, any shape, ``x`` plus the residual (``x`` alone when there is none), proven
            finite by the caller (finite ``sq_norms``; not checked again); consumed: it becomes
            the new residual.
        sq_norms : list of float
            The segments' squared L2 norms of ``v`` (fp32 reductions, as
            `segment_sq_norms` computes them).
        segments : list of int, optional
            As in [`compress`][fedcomp.compression.ErrorFeedback.compress].

        Returns
        -------
        bytes
            The payload of ``v``.

        Raises
        ------
        ValueError
            With momentum correction (its buffer enters before the residual: use
            [`compress`][fedcomp.compression.ErrorFeedback.compress]) or ``v`` not float32 (the state is left
            unchanged).
        """
        if self.momentum > 0:
            raise ValueError("compress_summed: momentum correction needs compress()")
        if v.dtype != torch.float32:
            raise ValueError(f"compress_summed: v must be float32, got {v.dtype}")
        return self._send(v.detach(), None, list(sq_norms), segments, finite=True)

    def _send(self, v: torch.Tensor, u: torch.Tensor | None, norms: list[float] | None,
              segments: list[int] | None, finite: bool = False) -> bytes:
        """Encode ``v`` (update + residual, float32, finite), keep its error as the residual (and mask
        the momentum buffer ``u`` where entries were sent); ``finite``: proven by the caller."""
        payload, norms, errors, sent = encode_and_subtract(self.compressor, v, segments, sent=u is not None,
                                                           sq_norms=norms, finite=finite)
        self.last_sq_error, self.last_sq_norm = float(sum(errors)), float(sum(norms))
        self.last_segment_sq_norms, self.last_segment_sq_errors = norms, errors
        self.last_error = (self.last_sq_error / self.last_sq_norm) ** 0.5 if self.last_sq_norm else 0.0
        store = _RESIDUAL_DTYPES[self.residual_dtype]
        if self.residual_dtype == "fp16":  # saturate: an Inf residual would poison every later round
            self._count_saturation(v)
            v = v.clamp_(-65504.0, 65504.0)
        if u is not None:  # momentum factor masking: forget u where entries were sent
            u.view(-1)[sent] = 0.0
            self.momentum_buffer = (u.clamp_(-65504.0, 65504.0) if store == torch.float16 else u).to(store)
        self.residual = v.to(store)
        return payload

    def _count_saturation(self, err: torch.Tensor) -> None:
        """Entries of the new residual beyond ±65504 and the relative L2 norm the clamp drops."""
        self.last_saturated, self.last_saturated_loss = 0, 0.0
        lo, hi = torch.aminmax(err) if err.numel() else (torch.zeros(()), torch.zeros(()))
        if float(hi) <= 65504.0 and float(lo) >= -65504.0:  # the usual case: one pass, no temporary
            return
        over = (err.abs() - 65504.0).clamp_(min=0.0)
        self.last_saturated = int(torch.count_nonzero(over))
        self.last_saturated_loss = float(torch.linalg.vector_norm(over.double())) / self.last_sq_norm ** 0.5

    @property
    def residual_norm(self) -> float:
        """L2 norm of the residual (0.0 before the first call)."""
        return 0.0 if self.residual is None else float(torch.linalg.vector_norm(self.residual.double()))

    def get_residual(self, copy: bool = True) -> np.ndarray | None:
        """The residual as a numpy array (its storage dtype, CPU), or None; for saving.

        ``copy=False`` returns a view of a CPU residual (valid until the next
        [`compress`][fedcomp.compression.ErrorFeedback.compress]).
        """
        if self.residual is None:
            return None
        out = self.residual.detach().cpu().numpy()
        return out.copy() if copy else out

    def set_residual(self, residual: np.ndarray | torch.Tensor | None, copy: bool = True, *,
                     check: bool = True) -> None:
        """Restore a residual saved with [`get_residual`][fedcomp.compression.ErrorFeedback.get_residual] (or any array
        of the input shape).

        ``copy=False`` keeps a reference when the dtype already matches (the next
        [`compress`][fedcomp.compression.ErrorFeedback.compress] only reads it, then replaces it), saving a model-sized
        copy. ``check=False`` skips the finiteness check when the caller has made it
        ([`set_state`][fedcomp.compression.ErrorFeedback.set_state]).

        Raises
        ------
        ValueError
            If it holds NaN/Inf.
        """
        if residual is None:
            self.residual = None
            return
        t = torch.as_tensor(residual).detach().to(_RESIDUAL_DTYPES[self.residual_dtype])
        if check and t.numel() and not bool(torch.isfinite(t.sum())) and not bool(torch.isfinite(t).all()):
            raise ValueError("residual holds non-finite values")
        self.residual = t.clone() if copy else t

    def get_state(self, copy: bool = True) -> dict[str, np.ndarray]:
        """The whole client-side state as numpy arrays (storage dtype, CPU), for saving.

        ``copy=False`` returns views of CPU buffers (valid until the next
        [`compress`][fedcomp.compression.ErrorFeedback.compress]).

        Returns
        -------
        dict of str to np.ndarray
            ``"residual"`` (input shape), ``"momentum"`` (DGC's u, input shape; only with
            momentum correction) and the codec's own entries as ``"<codec name>/<key>"``
            (e.g. ``"powersgd/q"``, float32 ``(n, r)``); entries not yet created are absent.
        """
        out: dict[str, np.ndarray] = {}
        if self.residual is not None:
            out[RESIDUAL] = self.get_residual(copy=copy)
        if self.momentum_buffer is not None:
            mom = self.momentum_buffer.detach().cpu().numpy()
            out[MOMENTUM] = mom.copy() if copy else mom
        out.update({f"{self.compressor.name}/{k}": v for k, v in self.compressor.get_state().items()})
        return out

    def set_state(self, state: Mapping[str, np.ndarray], shape: tuple[int, ...] | None = None,
                  copy: bool = True) -> list[str]:
        """Restore what [`get_state`][fedcomp.compression.ErrorFeedback.get_state] returned (missing entries start from
        zero / fresh).

        Parameters
        ----------
        state : mapping of str to array
            Entries as [`get_state`][fedcomp.compression.ErrorFeedback.get_state] names them; entries of another codec
            are ignored.
        shape : tuple of int, optional
            The shape of the coming input: a residual or momentum buffer of another shape is
            dropped (restarts at zero) instead of failing the next
            [`compress`][fedcomp.compression.ErrorFeedback.compress].
        copy : bool
            False keeps references to residual and momentum arrays whose dtype already matches
            (the next [`compress`][fedcomp.compression.ErrorFeedback.compress] only reads them, then replaces them).

        Returns
        -------
        list of str
            Names of the entries dropped for their shape.

        Raises
        ------
        ValueError
            An entry holds NaN/Inf or is not a float array (the state is left unchanged).
        """
        arrays = {k: np.asarray(v) for k, v in state.items()}
        for k, a in arrays.items():  # a finite sum proves every entry finite (fp32 sum: one cheap pass)
            if not np.issubdtype(a.dtype, np.floating) or (a.size and not np.isfinite(
                    a.sum(dtype=np.float32 if a.itemsize <= 4 else np.float64)) and not np.isfinite(a).all()):
                raise ValueError(f"state entry {k!r} is not a finite float array")
        dropped = [k for k in (RESIDUAL, MOMENTUM)
                   if k in arrays and shape is not None and tuple(arrays[k].shape) != tuple(shape)]
        prefix = f"{self.compressor.name}/"
        self.compressor.set_state({k[len(prefix):]: a for k, a in arrays.items() if k.startswith(prefix)})
        self.set_residual(None if RESIDUAL in dropped else arrays.get(RESIDUAL), copy=copy, check=False)
        mom = None if MOMENTUM in dropped else arrays.get(MOMENTUM)
        self.momentum_buffer = None if mom is None else torch.as_tensor(
            np.array(mom, copy=True) if copy else mom).to(_RESIDUAL_DTYPES[self.residual_dtype])
        return dropped

    def reset(self) -> None:
        """Forget the residual, the momentum buffer and the codec's memory."""
        self.residual = None
        self.momentum_buffer = None
        self.compressor.set_state({})


def flatten_states(states: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """``{payload key: ErrorFeedback.get_state()}`` -> one flat ``{name: array}`` dict to persist.

    The residual keeps the bare payload key (the layout of residual files); every other entry
    is stored as ``"<payload key>#<entry>"``, e.g. ``"conv1.weight#powersgd/q"``.
    """
    flat: dict[str, np.ndarray] = {}
    for ukey, st in states.items():
        for name, arr in st.items():
            flat[ukey if name == RESIDUAL else f"{ukey}{STATE_SEP}{name}"] = arr
    return flat


def unflatten_states(flat: Mapping[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """Inverse of `flatten_states`: ``{payload key: {entry: array}}``."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for key, arr in flat.items():
        ukey, sep, name = key.rpartition(STATE_SEP)
        if not sep or not (name == MOMENTUM or "/" in name):
            ukey, name = key, RESIDUAL
        out.setdefault(ukey, {})[name] = arr
    return out
