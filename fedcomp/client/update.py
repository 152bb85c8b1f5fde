"""From trained weights to payloads: ``delta = trained - received`` -> (local DP) -> error feedback -> encode.

Flower-free apart from the names of the protocol; used by ``compression_mod`` and the legacy
``CompressedNumPyClient``. Float tensors become updates compressed by the codec (one payload per
tensor, or one for the whole model with selection "model"); integer and bool tensors travel
exactly (:mod:`fedcomp.compression.exact`), except under local DP, where they are not sent at all.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from logging import WARNING
from typing import Any

import numpy as np
import torch
from flwr.common.logger import log

from fedcomp.protocol.broadcast import is_batchnorm_stat
from fedcomp.compression import CODECS, EF21, ErrorFeedback, encode_exact, flatten_states, unflatten_states
from fedcomp.compression.error_feedback import RESIDUAL, encode_and_subtract, segment_sq_norms
from fedcomp.config import CodecConfig
from fedcomp.config.model_policy import batchnorm_affine_keys
from fedcomp.privacy import LocalDP, clip_and_noise_, secure_generator
from fedcomp.protocol.messages import MODEL_KEY
from fedcomp.statedict import exact_cast, is_float_dtype
from fedcomp.client.replan import replan_states


class CompositionError(RuntimeError):
    """The ClientApp's reply cannot be compressed as it stands (wrong mod order, missing keys)."""


def plan_units(shapes: dict[str, tuple[int, ...]], codec: CodecConfig) -> list[tuple[str, list[str], str]]:
    """Group float parameters into payloads: ``[(payload key, member parameter names, codec name), ...]``.

    Per parameter, in order: the first ``layer-codecs`` rule whose pattern matches its name;
    else ``small-tensor-compressor`` if it has fewer than ``min-compress-numel`` elements;
    else the default ``compressor``. BatchNorm statistics (:func:`is_batchnorm_stat`) go to
    ``small-tensor-compressor`` while ``batchnorm-stats = "small"`` (a lossy codec can make a
    running variance negative), and so do BatchNorm's affine parameters with a sparse codec
    (stc, topk, randomk) while ``batchnorm-affine = "small"``
    (:func:`fedcomp.config.model_policy.batchnorm_affine_keys`). Default-codec parameters share one payload under
    ``MODEL_KEY`` (their updates flattened and concatenated in model order) when the scope is
    "model"; every other parameter gets its own payload under its own name. Pass float tensors
    only: integer and bool tensors never join a codec's payload.
    """
    rules = codec.rules
    sparse = CODECS[codec.compressor].sparse
    affine = set(batchnorm_affine_keys(shapes)) if codec.batchnorm_affine == "small" and sparse else set()
    default: list[str] = []
    units: list[tuple[str, list[str], str]] = []
    for key, shape in shapes.items():
        rule = next((c for pat, c in rules if fnmatch.fnmatchcase(key, pat)), None)
        n = int(np.prod(shape)) if shape else 1
        if rule is not None:
            units.append((key, [key], rule))
        elif (n < codec.min_compress_numel or (codec.batchnorm_stats == "small" and is_batchnorm_stat(key))
              or key in affine):
            units.append((key, [key], codec.small_tensor_compressor))
        elif codec.scope == "model":
            default.append(key)
        else:
            units.append((key, [key], codec.compressor))
    if default:
        units.append((MODEL_KEY, default, codec.compressor))
    return units


def adaptive_density(v: torch.Tensor, codec_name: str, target: float, lo: float, hi: float) -> float:
    """Smallest density in [lo, hi] whose relative error on ``v`` is <= ``target`` (else ``hi``).

    One sort of ``|v|`` and cumulative sums give every k's error at once: top-k leaves
    ``||v||^2 - sum_{i<=k} v_(i)^2``; STC (all kept values -> ±mu) leaves
    ``||v||^2 - (sum_{i<=k} |v|_(i))^2 / k``.
    """
    n = v.numel()
    mag = torch.sort(v.detach().abs().reshape(-1).double(), descending=True).values
    total = float((mag**2).sum())
    if n == 0 or total == 0.0:
        return lo
    kept = CODECS[codec_name].kept_energy(mag)
    err = torch.sqrt(torch.clamp(total - kept, min=0.0) / total)
    k_lo, k_hi = max(round(lo * n), 1), max(round(hi * n), 1)
    ok = torch.nonzero(err[k_lo - 1 : k_hi] <= target)
    return (k_lo + int(ok[0])) / n if len(ok) else hi


def _check_pair(received: dict, trained: dict, dtypes: dict) -> dict[str, np.ndarray]:
    """``trained`` in ``received``'s key order, after checking keys, shapes and dtype kinds.

    Raises
    ------
    CompositionError
        Other keys, another shape, or a float tensor returned for an integer one (or vice versa).
    """
    if set(received) != set(trained):
        missing = sorted(set(received) - set(trained))
        extra = sorted(set(trained) - set(received))
        raise CompositionError(
            f"trained weights have other keys than the received global model (missing {missing}, extra {extra}); "
            "the ClientApp must return the full model under the received names"
        )
    if MODEL_KEY in received:
        raise CompositionError(f"the model has a tensor named '{MODEL_KEY}', the name of fedcomp's whole-model "
                               "payload: rename that module or parameter")
    ordered = {k: trained[k] for k in received}  # the same keys in another order are fine
    for key, g in received.items():
        t = ordered[key]
        if tuple(np.shape(t)) != tuple(np.shape(g)):
            raise CompositionError(f"'{key}': trained shape {tuple(np.shape(t))} differs from received "
                                   f"{tuple(np.shape(g))}")
        if is_float_dtype(dtypes[key]) != (np.asarray(t).dtype.kind == "f"):
            raise CompositionError(f"'{key}': received a {dtypes[key]} tensor but the app returned {np.asarray(t).dtype}")
    return ordered


def _raise_not_finite(members: list[str], trained: dict, received: dict, codec_name: str) -> None:
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
            raise ValueError(f"update of the float64 tensor '{k}' reaches {float(d.max()):.3g}, beyond the float32 range "
                             f"(3.4e38) the codec '{codec_name}' computes in; refusing to compress (compressor 'none' "
                             "sends float64 tensors exactly in float64)")
    raise ValueError(f"the update of {members} is not finite in float32; refusing to compress")  # pragma: no cover


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
    """What encoding one :class:`Unit` produced: payload bytes, the codec state to keep (residual,
    momentum, codec memory; empty without error feedback), per-member squared norms of what was
    compressed (update + residual) and of its compression error (fp32 reductions), and the fp16
    residual's saturation (entries clamped, relative L2 lost)."""

    payload: bytes
    state: dict[str, np.ndarray]
    sq_norms: list[float]
    sq_errors: list[float]
    saturated: int = 0
    lost: float = 0.0


def plan_update(received: dict, trained: dict, codec: CodecConfig,
                dtypes: dict[str, str] | None) -> tuple[list[Unit], list[str], dict]:
    """Check ``trained`` against ``received`` and lay out the payloads.

    Returns
    -------
    (units, exact_keys, trained)
        The float payload units (:func:`plan_units` order), the integer/bool tensor names (model
        order) and ``trained`` in ``received``'s key order.

    Raises
    ------
    CompositionError
        As :func:`_check_pair`.
    """
    trained = _check_pair(received, trained, dtypes)
    float_keys = [k for k in received if is_float_dtype(dtypes[k])]
    shapes = {k: tuple(np.shape(received[k])) for k in float_keys}
    sizes = {k: int(np.prod(s)) if s else 1 for k, s in shapes.items()}
    units = []
    for ukey, members, name in plan_units(shapes, codec):
        # (EF21 keeps an estimate the server mirrors: its units stay on the float32 path.)
        wide = (name == "none" and codec.error_feedback != "ef21" and any(dtypes[k] == "float64" for k in members))
        seg = [sizes[k] for k in members]
        units.append(Unit(ukey, members, name, seg, (sum(seg),) if ukey == MODEL_KEY else shapes[ukey], wide))
    return units, [k for k in received if not is_float_dtype(dtypes[k])], trained


def encode_exact_tensors(keys: list[str], received: dict, trained: dict) -> dict[str, bytes]:
    """Integer and bool tensors as exact payloads in the model's own dtype (run first: a value that
    does not fit fails before any state moves).

    Raises
    ------
    ValueError
        A value outside the model's dtype (:func:`fedcomp.statedict.exact_cast`: never wrapped).
    """
    return {k: encode_exact(exact_cast(k, trained[k], np.asarray(received[k]).dtype)) for k in keys}


def write_delta(unit: Unit, received: dict, trained: dict, dtypes: dict[str, str],
                residual: np.ndarray | None = None,
                add_residual: bool = False) -> tuple[torch.Tensor, list[float], list[float] | None]:
    """``trained - received`` of a unit's members, written once into one new buffer, and its members'
    squared norms (which double as the finiteness check: finite norms prove every entry finite); with
    ``add_residual``, the error-feedback residual is added in the same pass, member by member while the
    member's entries are still in cache (the fused pass of classic error feedback,
    :meth:`fedcomp.compression.ErrorFeedback.compress_summed`).

    Parameters
    ----------
    unit : Unit
        The payload's layout.
    received, trained, dtypes
        As :func:`compress_update` has them (``trained`` in ``received``'s key order).
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
        finite: an overflow or a non-finite residual, which :func:`encode_unit` reports), else None.

    Raises
    ------
    ValueError
        The update holds NaN/Inf, or a float64 difference beyond the float32 range
        (:func:`_raise_not_finite` names the tensor).
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
                with np.errstate(over="ignore", invalid="ignore"):  # an overflow is reported by encode_summed
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


def summable_residual(unit: Unit, state: dict, codec: CodecConfig) -> tuple[bool, np.ndarray | None]:
    """Whether :func:`write_delta` may add this unit's residual in its own pass, and that residual.

    Only classic error feedback without momentum correction on a float32 unit, with a residual of
    the unit's shape already in the storage dtype (``residual-dtype``), or none: everything else
    (EF21, DGC's momentum, a wide unit, a residual to convert or of another shape) takes
    ``ErrorFeedback.compress``.

    Returns
    -------
    (bool, np.ndarray or None)
        Fusable, and the residual to add (None: none saved).
    """
    if unit.wide or codec.error_feedback is not True or codec.momentum_correction:
        return False, None
    prev = state.get(RESIDUAL)
    if prev is None:
        return True, None
    prev = np.asarray(prev)
    if tuple(prev.shape) != tuple(unit.shape) or prev.dtype != (np.float16 if codec.residual_dtype == "fp16"
                                                                else np.float32):
        return False, None
    return True, prev


def privatize(buffers: list[torch.Tensor], local_dp: LocalDP) -> None:
    """Local DP in place: clip the whole float update (all buffers together) to the clipping norm and
    add Gaussian noise from the OS CSPRNG (:func:`fedcomp.privacy.clip_and_noise_`)."""
    clip_and_noise_(buffers, local_dp.clipping_norm, local_dp.noise_multiplier, secure_generator())


def restore_states(residuals: dict[str, np.ndarray], units: list[Unit], codec: CodecConfig,
                   shapes: dict[str, tuple[int, ...]]) -> dict[str, dict[str, np.ndarray]]:
    """Saved client state per payload key (:func:`fedcomp.compression.unflatten_states`), regrouped for
    this round's plan when error feedback is on (:func:`fedcomp.client.replan.replan_states`; what does
    not fit is dropped with a warning and restarts at zero)."""
    states = unflatten_states(residuals)
    if codec.error_feedback:  # a warm-up codec or rule may have grouped the payloads otherwise last round
        states, dropped = replan_states(states, [(u.key, u.members, u.codec) for u in units], shapes)
        for skey in dropped:
            log(WARNING, "fedcomp: saved state of '%s' does not fit the model's parameters: starting from zero", skey)
    return states


def unit_density(unit: Unit, x: torch.Tensor, prev: np.ndarray | None, codec: CodecConfig) -> float | None:
    """The density of a unit's sparse codec: ``density``, or the adaptive one measured on what is
    compressed (update + residual; update - estimate with EF21); None for the other codecs."""
    if unit.codec != codec.compressor or not CODECS[unit.codec].sparse:
        return None
    if codec.density_schedule != "adaptive":
        return codec.density
    v = x if prev is None else x + torch.as_tensor(prev).float() * (-1.0 if codec.error_feedback == "ef21" else 1.0)
    return adaptive_density(v, unit.codec, codec.target_error, codec.density_min, codec.density_max)


def encode_wide(unit: Unit, x: torch.Tensor, state: dict, codec: CodecConfig, seed: int | None) -> UnitResult:
    """A float64 unit sent exactly: nothing to feed back; a residual left by a lossy codec (an earlier
    round's plan) is added and sent now. Its compression error is 0."""
    prev = state.get("residual") if codec.error_feedback else None
    if prev is not None and tuple(prev.shape) == tuple(x.shape):
        x += torch.as_tensor(np.asarray(prev)).to(torch.float64)
    payload = codec.build(seed=seed, compressor=unit.codec).compress(x)
    norms = segment_sq_norms(x.reshape(-1), unit.sizes)
    return UnitResult(payload, {}, norms, [0.0] * len(norms))


def encode_with_feedback(unit: Unit, x: torch.Tensor, state: dict, compressor, codec: CodecConfig) -> UnitResult:
    """Classic error feedback (or EF21, or DGC's momentum correction): the state object compresses
    ``x`` with its memory (:class:`fedcomp.compression.ErrorFeedback` owns the residual add and the
    error subtraction); ``x`` (float32) is consumed as its workspace."""
    ef = (EF21(compressor, residual_dtype=codec.residual_dtype) if codec.error_feedback == "ef21" else
          ErrorFeedback(compressor, residual_dtype=codec.residual_dtype, momentum=codec.momentum_correction))
    for entry in ef.set_state(state, shape=tuple(x.shape), copy=False):
        if entry != "residual":  # a residual's mismatch is logged by the caller
            log(WARNING, "fedcomp: saved %s for '%s' has another shape: starting from zero", entry, unit.key)
    payload = ef.compress(x, inplace=True, segments=unit.sizes)
    return UnitResult(payload, ef.get_state(copy=False), ef.last_segment_sq_norms, ef.last_segment_sq_errors,
                      ef.last_saturated, ef.last_saturated_loss)


def encode_without_feedback(unit: Unit, x: torch.Tensor, compressor) -> UnitResult:
    """No error feedback: compress ``x`` and keep nothing; ``x`` (float32) becomes the error, used only
    for the statistics (:func:`fedcomp.compression.error_feedback.encode_and_subtract`)."""
    payload, norms, errors, _ = encode_and_subtract(compressor, x, unit.sizes)
    return UnitResult(payload, {}, norms, errors)


def encode_summed(unit: Unit, v: torch.Tensor, sum_norms: list[float], state: dict, compressor,
                  codec: CodecConfig) -> UnitResult:
    """Classic error feedback on ``v = update + residual`` that :func:`write_delta` formed in its own
    pass (:func:`summable_residual`): the same checks, payload and new state as
    :func:`encode_with_feedback`, without the residual add and its passes.

    Raises
    ------
    ValueError
        The saved residual is not finite, or update + residual overflows float32 (the messages of
        ``ErrorFeedback.set_state`` and ``ErrorFeedback.compress``).
    """
    if not math.isfinite(sum(sum_norms)) and not bool(torch.isfinite(v).all()):
        prev = state.get(RESIDUAL)
        if prev is not None and not np.isfinite(np.asarray(prev)).all():
            raise ValueError(f"state entry {RESIDUAL!r} is not a finite float array")
        raise ValueError("input + residual overflows float32; residual left unchanged")
    ef = ErrorFeedback(compressor, residual_dtype=codec.residual_dtype)
    others = {k: a for k, a in state.items() if k != RESIDUAL}  # the residual is in v already
    for entry in ef.set_state(others, shape=tuple(v.shape), copy=False):
        log(WARNING, "fedcomp: saved %s for '%s' has another shape: starting from zero", entry, unit.key)
    payload = ef.compress_summed(v, sum_norms, segments=unit.sizes)
    return UnitResult(payload, ef.get_state(copy=False), ef.last_segment_sq_norms, ef.last_segment_sq_errors,
                      ef.last_saturated, ef.last_saturated_loss)


def encode_unit(unit: Unit, x: torch.Tensor, state: dict, codec: CodecConfig,
                seed: int | None, sum_norms: list[float] | None = None) -> tuple[UnitResult, float | None]:
    """Encode one unit's update ``x`` (its buffer, consumed) with the codec and the saved ``state``.

    ``sum_norms``: ``x`` holds update + residual already (:func:`write_delta` with
    ``add_residual``), these are its members' squared norms.

    Returns
    -------
    (UnitResult, density)
        The result and the density its sparse codec used (None for other codecs).
    """
    if unit.wide:
        return encode_wide(unit, x, state, codec, seed), None
    prev = state.get("residual") if codec.error_feedback else None
    if prev is not None and tuple(prev.shape) != tuple(x.shape):
        log(WARNING, "fedcomp: residual for '%s' has shape %s, the update %s: starting from zero", unit.key,
            tuple(prev.shape), tuple(x.shape))
        prev = None
    if sum_norms is not None:
        if not math.isfinite(sum(sum_norms)) and not bool(torch.isfinite(x).all()):
            density = None  # encode_summed raises
        else:
            density = unit_density(unit, x, None, codec)  # x is update + residual already
        compressor = codec.build(seed=seed, compressor=unit.codec, density=density)
        return encode_summed(unit, x, sum_norms, state, compressor, codec), density
    density = unit_density(unit, x, prev, codec)
    compressor = codec.build(seed=seed, compressor=unit.codec, density=density)
    if codec.error_feedback:
        return encode_with_feedback(unit, x, state, compressor, codec), density
    return encode_without_feedback(unit, x, compressor), density


def chunked_sq_norm(a: np.ndarray, chunk: int = 1 << 20) -> float:
    """Squared L2 norm of any float array ``a`` (any shape; fp16/bf16/fp32/fp64), accumulated in fp32 (fp64 for
    fp64) over flat chunks of ``chunk`` entries, so an fp16 residual is never copied whole to fp32 (at most
    ``chunk`` entries, 4 MiB, at a time). Returns a Python float (units of ``a`` squared)."""
    flat = torch.from_numpy(np.ascontiguousarray(a)).reshape(-1)
    wide = torch.float64 if flat.dtype == torch.float64 else torch.float32
    return sum(float(torch.linalg.vector_norm(flat[i:i + chunk].to(wide))) ** 2 for i in range(0, flat.numel(), chunk))


def summarize(units: list[Unit], results: dict[str, UnitResult], payloads: dict[str, bytes],
              update_sq: dict[str, float], exact_bytes: int, density: float, codec: CodecConfig) -> dict[str, Any]:
    """The reply's statistics (see :func:`compress_update`, Returns) from the units' results."""
    layer_sq_norm = {k: n2 for u in units for k, n2 in zip(u.members, results[u.key].sq_norms)}
    layer_sq_err = {k: e2 for u in units for k, e2 in zip(u.members, results[u.key].sq_errors)}
    float_keys = [k for k in update_sq]
    sq_err, sq_norm = sum(layer_sq_err.values()), sum(layer_sq_norm.values())
    if codec.error_feedback is True and codec.residual_dtype == "fp32":
        res_sq = sq_err  # an fp32 residual is the compression error itself: no extra pass
    else:
        res_sq = sum(chunked_sq_norm(r.state["residual"]) for r in results.values() if "residual" in r.state)
    return {
        "upload-bytes": float(sum(len(p) for p in payloads.values())),
        "dense-bytes": float(4 * sum(sum(u.sizes) for u in units) + exact_bytes),
        "compression-error": (sq_err / sq_norm) ** 0.5 if sq_norm > 0 else 0.0,
        "residual-norm": res_sq**0.5,
        "density": float(density),
        "residual-saturated": float(sum(r.saturated for r in results.values())),  # fp16 residual clamp
        "residual-saturated-loss": max((r.lost for r in results.values()), default=0.0),
        "layer-update-norm": [update_sq[k] ** 0.5 for k in float_keys],
        "layer-compression-error": [(layer_sq_err[k] / layer_sq_norm[k]) ** 0.5 if layer_sq_norm[k] > 0 else 0.0
                                    for k in float_keys],
    }


def compress_update(
    received: dict[str, np.ndarray], trained: dict[str, np.ndarray], codec: CodecConfig,
    residuals: dict[str, np.ndarray], seed: int | None = None, local_dp: LocalDP | None = None,
    dtypes: dict[str, str] | None = None,
) -> tuple[dict[str, bytes], dict[str, np.ndarray], dict[str, Any]]:
    """Compress ``trained - received`` with error feedback: float tensors per parameter or as one
    model vector, integer/bool tensors exactly.

    Stages: :func:`plan_update` -> :func:`encode_exact_tensors` -> :func:`restore_states` ->
    :func:`write_delta` (per unit, finiteness checked; under classic error feedback the residual is
    added in the same pass, :func:`summable_residual`) -> :func:`privatize` (local DP) ->
    :func:`encode_unit` (error feedback + codec) -> :func:`summarize`.

    Parameters
    ----------
    received, trained : dict of str to np.ndarray
        Global weights as received and the locally trained weights; the same keys (``trained``
        may list them in another order) and shapes. bf16 tensors as float32 values.
    codec : CodecConfig
        Codec, per-layer policy, adaptive density and error-feedback settings.
    residuals : dict of str to np.ndarray
        Client state from earlier rounds as :func:`fedcomp.compression.flatten_states` lays it
        out (may be empty): the residual under its payload key, DGC's momentum and codec memory
        such as PowerSGD's Q under ``"<payload key>#<entry>"``; entries of another shape are
        ignored (they restart at 0). Saved under another payload plan (a warm-up codec, a
        per-layer rule), residual and momentum are regrouped per parameter for this round's
        plan (:func:`fedcomp.client.replan.replan_states`), so nothing sent is lost.
    seed : int, optional
        Seed of stochastic codecs (qsgd, int8, randomk). Never used for privacy noise.
    local_dp : LocalDP, optional
        Clip the whole float update and add Gaussian noise drawn from the OS CSPRNG first, before
        error feedback and compression (so every selection is made on the noisy update, and the
        residual is kept of the noisy vector). Integer and bool tensors are then not sent at all
        (an exact counter such as ``num_batches_tracked`` would reveal the number of local batches).
    dtypes : dict of str to str, optional
        The model's dtype names (``"bfloat16"`` for bf16); default: ``received``'s numpy dtypes.

    Returns
    -------
    (payloads, new_residuals, stats)
        Payload bytes per payload key (see :func:`plan_units`; integer/bool tensors under their
        own names); residual per payload key (empty without error feedback); and
        ``upload-bytes``, ``dense-bytes`` (4 bytes per float parameter plus the integer tensors'
        own bytes), ``compression-error`` (||v - v_hat|| / ||v|| over the float model, v = update
        + residual), ``residual-norm``, ``density`` (fraction of entries kept by the default
        sparse codec, adaptive or not; 1.0 when the default codec keeps every entry: sign, int8,
        qsgd, ...), ``residual-saturated`` (fp16 residual entries clamped at
        ±65504) and ``residual-saturated-loss`` (the largest relative L2 a payload lost so), and
        per-parameter lists in model order (float tensors) ``layer-update-norm`` (||update||) and
        ``layer-compression-error``. Norms are float32 reductions.

    Raises
    ------
    CompositionError
        Keys, shapes or dtype kinds differ between ``received`` and ``trained``.
    ValueError
        The update holds NaN/Inf (residuals are then left unchanged); an integer/bool tensor holds
        a value outside the model's dtype (:func:`fedcomp.statedict.exact_cast`: never wrapped).
    """
    dtypes = dtypes or {k: str(np.asarray(v).dtype) for k, v in received.items()}
    units, exact_keys, trained = plan_update(received, trained, codec, dtypes)
    exact_payloads = {} if local_dp is not None else encode_exact_tensors(exact_keys, received, trained)
    float_keys = [k for k in received if is_float_dtype(dtypes[k])]
    states = restore_states(residuals, units, codec, {k: tuple(np.shape(received[k])) for k in float_keys})
    buffers, norms, sums = {}, {}, {}
    for u in units:  # classic error feedback: the residual is added in the delta's own pass
        fused, prev = summable_residual(u, states.get(u.key, {}), codec) if local_dp is None else (False, None)
        buffers[u.key], norms[u.key], sums[u.key] = write_delta(u, received, trained, dtypes, prev, fused)
    if local_dp is not None:
        privatize(list(buffers.values()), local_dp)
        norms = {u.key: segment_sq_norms(buffers[u.key].reshape(-1), u.sizes) for u in units}  # of the noisy update
    update_sq = {k: n2 for u in units for k, n2 in zip(u.members, norms[u.key])}
    update_sq = {k: update_sq[k] for k in received if k in update_sq}  # model order
    results: dict[str, UnitResult] = {}
    used_density = 1.0  # a dense codec sends every entry
    for u in units:
        results[u.key], density = encode_unit(u, buffers.pop(u.key), states.get(u.key, {}), codec, seed,
                                              sums.pop(u.key))
        used_density = used_density if density is None else density
    payloads = {key: r.payload for key, r in results.items()}
    payloads.update(exact_payloads)
    exact_bytes = sum(np.asarray(received[k]).nbytes for k in exact_keys)
    stats = summarize(units, results, payloads, update_sq, exact_bytes, used_density, codec)
    return payloads, flatten_states({key: r.state for key, r in results.items()}), stats


__all__ = ["CompositionError", "Unit", "UnitResult", "adaptive_density", "compress_update", "encode_exact_tensors",
           "encode_summed", "encode_unit", "plan_units", "plan_update", "privatize", "restore_states",
           "summable_residual", "summarize", "write_delta"]
