"""The error-feedback entry point: one payload's update from trained weights to bytes and new state.

`feedback_pass` is called once per payload by the client: it forms ``delta = trained -
received`` into one new buffer, adds the saved residual in that same pass when it can
(`summable_residual`), takes the norms that double as the finiteness check, compresses with
the codec and the memory the settings name ([`ErrorFeedback`][fedcomp.compression.ErrorFeedback], DGC's
momentum correction, `EF21`, or none) and returns the payload, the state
to keep and the statistics. Local DP, which clips the whole model's update before any payload is
encoded, hands the noisy buffer in instead (``delta``).

Sources: Stich, Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS 2018; Karimireddy et al.,
"Error Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML 2019; Lin et al.,
"Deep Gradient Compression", ICLR 2018; Richtárik, Sokolov, Fatkhullin, "EF21", NeurIPS 2021.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from fedcomp.compression.base import Compressor
from fedcomp.compression.ef21 import EF21
from fedcomp.compression.error_feedback import RESIDUAL, ErrorFeedback, encode_and_subtract, segment_sq_norms


class FeedbackSettings(Protocol):
    """What `feedback_pass` reads of the settings (``fedcomp.config.CodecConfig`` has these)."""

    #: False (none), True (classic error feedback) or "ef21".
    error_feedback: bool | str
    #: Storage of the residual and the momentum buffer: "fp32" or "fp16".
    residual_dtype: str
    #: DGC's momentum-correction factor in [0, 1); 0 turns it off.
    momentum_correction: float


@dataclass(frozen=True)
class Unit:
    """One payload of the update: its key, member parameters (model order), codec and layout.

    ``sizes`` are the members' element counts (a 0-d tensor counts 1); ``shape`` is the
    payload's tensor shape (the parameter's own, or ``(sum(sizes),)`` for the whole-model
    payload); ``wide``: sent exactly in float64 (codec "none" with a float64 member, classic
    error feedback or none), so its buffer is float64.
    """

    key: str
    members: list[str]
    codec: str
    sizes: list[int]
    shape: tuple[int, ...]
    wide: bool


@dataclass
class UnitResult:
    """What encoding one `Unit` produced: payload bytes, the codec state to keep (residual,
    momentum, codec memory; empty without error feedback), per-member squared norms of what was
    compressed (update + residual) and of its compression error (fp32 reductions), the fp16
    residual's saturation (entries clamped, relative L2 lost), the density its codec used (None:
    the codec's own or not sparse) and per-member squared norms of the update alone."""

    payload: bytes
    state: dict[str, np.ndarray]
    sq_norms: list[float]
    sq_errors: list[float]
    saturated: int = 0
    lost: float = 0.0
    density: float | None = None
    update_sq_norms: list[float] = field(default_factory=list)


#: A sparse codec's density: a fraction, a rule measuring it on what is compressed, or None.
Density = float | Callable[[torch.Tensor], float] | None
#: Called when a saved state entry is dropped for its shape: (entry name, saved shape).
OnDrop = Callable[[str, tuple[int, ...]], None]


def feedback_pass(unit: Unit, state: Mapping[str, np.ndarray], build: Callable[[float | None], Compressor],
                  settings: FeedbackSettings, *, pair: tuple[Mapping, Mapping, Mapping[str, str]] | None = None,
                  delta: tuple[torch.Tensor, list[float]] | None = None, density: Density = None,
                  on_drop: OnDrop | None = None) -> UnitResult:
    """Encode one payload's update with error feedback: delta, residual, norms, codec, new state.

    Parameters
    ----------
    unit : Unit
        The payload's layout.
    state : mapping of str to np.ndarray
        The payload's saved state ([`ErrorFeedback.get_state`][fedcomp.compression.ErrorFeedback.get_state] names);
        read, never written.
    build : callable
        ``build(density)`` returns the payload's codec (``density`` None: the codec's own).
    settings : FeedbackSettings
        Error-feedback mode, residual storage and momentum correction.
    pair : (trained, received, dtypes), optional
        The weights as dicts of numpy arrays (``trained`` in ``received``'s key order, the same
        shapes) and the model's dtype names; the update is formed here.
    delta : (torch.Tensor, list of float), optional
        Instead of ``pair``: the update already formed (shape ``unit.shape``; float64 for a wide
        unit, else float32; consumed) and its members' squared norms.
    density : float or callable, optional
        A callable is given what the codec compresses (update + residual; update - estimate
        under EF21) and returns the density.
    on_drop : callable, optional
        Told of each saved residual, momentum buffer or entry dropped for its shape (it restarts
        at zero).

    Returns
    -------
    UnitResult
        Payload, new state, statistics, the density used and the update's norms.

    Raises
    ------
    ValueError
        The update holds NaN/Inf or a float64 difference beyond the float32 range (naming the
        tensor); a saved state entry is not finite; update + residual overflows float32. The
        saved state is never modified.
    """
    if delta is None:
        trained, received, dtypes = pair
        fused, prev = summable_residual(unit, state, settings)
        x, update_sq, sums = write_delta(unit, received, trained, dtypes, prev, fused)
    else:
        (x, update_sq), fused, sums = delta, False, None
    if unit.wide:
        result = _send_exactly(unit, x, state, build, settings)
    elif fused:
        result = _send_summed(unit, x, sums, state, build, settings, density, on_drop)
    elif settings.error_feedback:
        result = _send_with_memory(unit, x, update_sq, state, build, settings, density, on_drop)
    else:
        d = _resolve(density, x)
        payload, norms, errors, _ = encode_and_subtract(build(d), x, unit.sizes, sq_norms=update_sq,
                                                        finite=math.isfinite(sum(update_sq)))
        result = UnitResult(payload, {}, norms, errors, density=d)
    result.update_sq_norms = update_sq
    return result


def _resolve(density: Density, v: torch.Tensor) -> float | None:
    """The density for what is compressed, ``v`` (measured only by a rule)."""
    return density(v) if callable(density) else density


def _memory(compressor: Compressor, settings: FeedbackSettings) -> ErrorFeedback:
    """The state object of the settings' error feedback around ``compressor``."""
    if settings.error_feedback == "ef21":
        return EF21(compressor, residual_dtype=settings.residual_dtype)
    return ErrorFeedback(compressor, residual_dtype=settings.residual_dtype, momentum=settings.momentum_correction)


def _restore(memory: ErrorFeedback, state: Mapping[str, np.ndarray], shape: tuple[int, ...],
             on_drop: OnDrop | None, skip: str | None = None) -> None:
    """Load ``state`` into ``memory``; entries of another shape than ``shape`` are reported (``skip``:
    one already reported)."""
    for entry in memory.set_state(state, shape=shape, copy=False):
        if on_drop is not None and entry != skip:
            on_drop(entry, tuple(np.shape(state[entry])))


def _result(memory: ErrorFeedback, payload: bytes, density: float | None) -> UnitResult:
    return UnitResult(payload, memory.get_state(copy=False), memory.last_segment_sq_norms,
                      memory.last_segment_sq_errors, memory.last_saturated, memory.last_saturated_loss, density)


def _send_exactly(unit: Unit, x: torch.Tensor, state: Mapping, build, settings: FeedbackSettings) -> UnitResult:
    """A float64 unit sent exactly: nothing to feed back; a residual left by a lossy codec (an earlier
    round's plan) is added and sent now. Its compression error is 0."""
    prev = state.get(RESIDUAL) if settings.error_feedback else None
    if prev is not None and tuple(prev.shape) == tuple(x.shape):
        x += torch.as_tensor(np.asarray(prev)).to(torch.float64)
    payload = build(None).compress(x)
    norms = segment_sq_norms(x.reshape(-1), unit.sizes)
    return UnitResult(payload, {}, norms, [0.0] * len(norms))


def _send_summed(unit: Unit, v: torch.Tensor, sum_norms: list[float], state: Mapping, build,
                 settings: FeedbackSettings, density: Density, on_drop: OnDrop | None) -> UnitResult:
    """Classic error feedback on ``v = update + residual`` formed by `write_delta`: the payload
    and new state of [`ErrorFeedback.compress`][fedcomp.compression.ErrorFeedback.compress] on the update, without its
    residual pass."""
    if not math.isfinite(sum(sum_norms)) and not bool(torch.isfinite(v).all()):
        prev = state.get(RESIDUAL)
        if prev is not None and not np.isfinite(np.asarray(prev)).all():
            raise ValueError(f"state entry {RESIDUAL!r} is not a finite float array")
        raise ValueError("input + residual overflows float32; residual left unchanged")
    d = _resolve(density, v)
    memory = _memory(build(d), settings)
    _restore(memory, {k: a for k, a in state.items() if k != RESIDUAL}, tuple(v.shape), on_drop)  # v holds it
    return _result(memory, memory.compress_summed(v, sum_norms, segments=unit.sizes), d)


def _send_with_memory(unit: Unit, x: torch.Tensor, update_sq: list[float], state: Mapping, build,
                      settings: FeedbackSettings, density: Density, on_drop: OnDrop | None) -> UnitResult:
    """Classic error feedback with its own residual add, DGC's momentum correction or EF21: the
    memory compresses ``x`` (float32, consumed as its workspace)."""
    prev = state.get(RESIDUAL)
    if prev is not None and tuple(prev.shape) != tuple(x.shape):
        if on_drop is not None:
            on_drop(RESIDUAL, tuple(prev.shape))
        prev = None
    if callable(density):
        sign = -1.0 if settings.error_feedback == "ef21" else 1.0
        d = density(x if prev is None else x + torch.as_tensor(prev).float() * sign)
    else:
        d = density
    memory = _memory(build(d), settings)
    _restore(memory, state, tuple(x.shape), on_drop, skip=RESIDUAL)
    payload = memory.compress(x, inplace=True, segments=unit.sizes, finite=math.isfinite(sum(update_sq)))
    return _result(memory, payload, d)


def summable_residual(unit: Unit, state: Mapping, settings: FeedbackSettings) -> tuple[bool, np.ndarray | None]:
    """Whether `write_delta` may add this unit's residual in its own pass, and that residual.

    Only classic error feedback without momentum correction on a float32 unit, with a residual of
    the unit's shape already in the storage dtype (``residual-dtype``), or none: everything else
    (EF21, DGC's momentum, a wide unit, a residual to convert or of another shape) takes
    [`ErrorFeedback.compress`][fedcomp.compression.ErrorFeedback.compress].

    Returns
    -------
    (bool, np.ndarray or None)
        Fusable, and the residual to add (None: none saved).
    """
    if unit.wide or settings.error_feedback is not True or settings.momentum_correction:
        return False, None
    prev = state.get(RESIDUAL)
    if prev is None:
        return True, None
    prev = np.asarray(prev)
    if tuple(prev.shape) != tuple(unit.shape) or prev.dtype != (np.float16 if settings.residual_dtype == "fp16"
                                                                else np.float32):
        return False, None
    return True, prev


def write_delta(unit: Unit, received: Mapping, trained: Mapping, dtypes: Mapping[str, str],
                residual: np.ndarray | None = None,
                add_residual: bool = False) -> tuple[torch.Tensor, list[float], list[float] | None]:
    """``trained - received`` of a unit's members, written once into one new buffer, and its members'
    squared norms (which double as the finiteness check: finite norms prove every entry finite); with
    ``add_residual``, the error-feedback residual is added in the same pass, member by member while the
    member's entries are still in cache.

    Parameters
    ----------
    unit : Unit
        The payload's layout.
    received, trained : mapping of str to np.ndarray
        The weights (``trained`` in ``received``'s key order, the same shapes).
    dtypes : mapping of str to str
        The model's dtype names (``"float64"`` members of a float32 unit are subtracted in float64).
    residual : np.ndarray, optional
        With ``add_residual``: the saved residual, ``unit.shape``, float32 or float16 (added
        entry by entry in float32, as ``ErrorFeedback.compress`` adds it), or None (none saved).
    add_residual : bool
        Form ``update + residual`` and return its norms too (float32 units only).

    Returns
    -------
    (torch.Tensor, list of float, list of float or None)
        Shape ``unit.shape``; float64 for a wide unit, else float32 (a float64 member's difference
        is taken in float64, then rounded); the members flattened in order; with ``add_residual``
        it holds ``update + residual``. Squared L2 norm per member of the update (the buffer's
        dtype's reduction), and with ``add_residual`` of ``update + residual`` (possibly not
        finite: an overflow or a non-finite residual, which `feedback_pass` reports), else None.

    Raises
    ------
    ValueError
        The update holds NaN/Inf, or a float64 difference beyond the float32 range (naming the tensor).
    """
    buf = np.empty(sum(unit.sizes), dtype=np.float64 if unit.wide else np.float32)
    t = torch.from_numpy(buf)
    res = None if residual is None else np.asarray(residual).reshape(-1)
    sq_norms: list[float] = []
    sum_norms: list[float] | None = [] if add_residual else None
    off = 0
    for k, size in zip(unit.members, unit.sizes):
        seg = buf[off: off + size]
        t_k, r_k = np.asarray(trained[k]).reshape(-1), np.asarray(received[k]).reshape(-1)
        if dtypes[k] == "float64" and buf.dtype == np.float32:  # the difference in float64, then rounded
            with np.errstate(over="ignore", invalid="ignore"):
                seg[...] = np.subtract(t_k, r_k, dtype=np.float64)
        else:
            np.subtract(t_k, r_k, out=seg, dtype=buf.dtype, casting="unsafe")
        if add_residual:  # norms of the same slices as segment_sq_norms takes: the same fp32 reductions
            n2 = float(torch.linalg.vector_norm(t[off: off + size])) ** 2 if size else 0.0
            sq_norms.append(n2)
            # Checked before any residual moves; only a non-finite norm (possibly a mere overflow) needs the full check.
            if not math.isfinite(n2) and not bool(np.isfinite(seg).all()):
                _raise_not_finite(unit.members, trained, received, unit.codec)
            if res is not None:
                with np.errstate(over="ignore", invalid="ignore"):  # an overflow is reported by feedback_pass
                    np.add(seg, res[off: off + size], out=seg)
                sum_norms.append(float(torch.linalg.vector_norm(t[off: off + size])) ** 2 if size else 0.0)
            else:
                sum_norms.append(n2)
        off += size
    if not add_residual:
        sq_norms = segment_sq_norms(t, unit.sizes)
        # Checked before any residual moves; only non-finite norms (possibly a mere overflow) need the full check.
        if not math.isfinite(sum(sq_norms)) and not bool(torch.isfinite(t).all()):
            _raise_not_finite(unit.members, trained, received, unit.codec)
    return t.reshape(unit.shape), sq_norms, sum_norms


def _raise_not_finite(members: list[str], trained: Mapping, received: Mapping, codec_name: str) -> None:
    """Name the tensor whose update is not finite: NaN/Inf, or a float64 difference beyond float32's
    range (a lossy codec computes in float32).

    Raises
    ------
    ValueError
        Always.
    """
    for k in members:
        with np.errstate(over="ignore", invalid="ignore"):
            d = np.asarray(trained[k], np.float64) - np.asarray(received[k], np.float64)
        if not np.isfinite(d).all():
            raise ValueError(f"update of '{k}' holds non-finite values (NaN or Inf); refusing to compress")
    for k in members:
        d = np.abs(np.asarray(trained[k], np.float64) - np.asarray(received[k], np.float64))
        if d.size and float(d.max()) > float(np.finfo(np.float32).max):
            raise ValueError(f"update of the float64 tensor '{k}' reaches {float(d.max()):.3g}, beyond the float32 "
                             f"range (3.4e38) the codec '{codec_name}' computes in; refusing to compress "
                             "(compressor 'none' sends float64 tensors exactly in float64)")
    raise ValueError(f"the update of {members} is not finite in float32; refusing to compress")  # pragma: no cover


__all__ = ["FeedbackSettings", "Unit", "UnitResult", "feedback_pass", "summable_residual", "write_delta"]
