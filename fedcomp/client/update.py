"""From trained weights to payloads: ``delta = trained - received`` -> (local DP) -> error feedback -> encode.

Flower-free apart from the names of the protocol; used by ``compression_mod`` and the legacy
``CompressedNumPyClient``. Float tensors become updates compressed by the codec (one payload per
tensor, or one for the whole model with selection "model"); integer and bool tensors travel
exactly (:mod:`fedcomp.compression.exact`), except under local DP, where they are not sent at all.
"""

from __future__ import annotations

import fnmatch
from logging import WARNING
from typing import Any

import numpy as np
import torch
from flwr.common.logger import log

from ..broadcast import is_batchnorm_stat  # noqa: F401 (re-exported)
from ..compression import (
    EF21,
    ErrorFeedback,
    decompress,
    decompress_sparse,
    encode_exact,
    flatten_states,
    unflatten_states,
)
from ..config import SPARSE_CODECS, CodecConfig
from ..model_policy import batchnorm_affine_keys
from ..privacy import LocalDP, clip_and_noise_, secure_generator
from ..protocol import MODEL_KEY
from ..statedict import exact_cast, is_float_dtype
from .replan import replan_states


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
    (:func:`fedcomp.model_policy.batchnorm_affine_keys`). Default-codec parameters share one payload under
    ``MODEL_KEY`` (their updates flattened and concatenated in model order) when the scope is
    "model"; every other parameter gets its own payload under its own name. Pass float tensors
    only: integer and bool tensors never join a codec's payload.
    """
    rules = codec.rules
    sparse = codec.compressor in SPARSE_CODECS
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
    k = torch.arange(1, n + 1, dtype=torch.float64)
    kept = torch.cumsum(mag, 0) ** 2 / k if codec_name == "stc" else torch.cumsum(mag**2, 0)
    err = torch.sqrt(torch.clamp(total - kept, min=0.0) / total)
    k_lo, k_hi = max(int(round(lo * n)), 1), max(int(round(hi * n)), 1)
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


def _raise_not_finite(members: list[str], trained: dict, received: dict, units, ukey: str) -> None:
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
            name = next(n for u, _, n in units if u == ukey)
            raise ValueError(f"update of the float64 tensor '{k}' reaches {float(d.max()):.3g}, beyond the float32 range "
                             f"(3.4e38) the codec '{name}' computes in; refusing to compress (compressor 'none' "
                             "sends float64 tensors exactly in float64)")
    raise ValueError(f"the update of {members} is not finite in float32; refusing to compress")  # pragma: no cover


def compress_update(
    received: dict[str, np.ndarray], trained: dict[str, np.ndarray], codec: CodecConfig,
    residuals: dict[str, np.ndarray], seed: int | None = None, local_dp: LocalDP | None = None,
    dtypes: dict[str, str] | None = None,
) -> tuple[dict[str, bytes], dict[str, np.ndarray], dict[str, Any]]:
    """Compress ``trained - received`` with error feedback: float tensors per parameter or as one
    model vector, integer/bool tensors exactly.

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
    trained = _check_pair(received, trained, dtypes)
    float_keys = [k for k in received if is_float_dtype(dtypes[k])]
    exact_keys = [k for k in received if k not in set(float_keys)]
    sizes = {k: int(np.prod(np.shape(received[k]))) if np.shape(received[k]) else 1 for k in float_keys}
    units = plan_units({k: tuple(np.shape(received[k])) for k in float_keys}, codec)
    # Integer/bool tensors first: a value that does not fit the model's dtype fails before any state moves.
    exact_payloads = {} if local_dp is not None else {
        k: encode_exact(exact_cast(k, trained[k], np.asarray(received[k]).dtype)) for k in exact_keys}

    # The update, written once into one buffer per payload (no per-key copies, no concat): float32, or
    # float64 where the codec is the exact `none` and a member is float64 (float64 stays float64).
    buffers: dict[str, torch.Tensor] = {}
    # (EF21 keeps an estimate the server mirrors: its units stay on the float32 path.)
    wide_units = {ukey for ukey, members, name in units if name == "none" and codec.error_feedback != "ef21"
                  and any(dtypes[k] == "float64" for k in members)}
    for ukey, members, _ in units:
        buf = np.empty(sum(sizes[k] for k in members), dtype=np.float64 if ukey in wide_units else np.float32)
        off = 0
        for k in members:
            seg = buf[off: off + sizes[k]]
            t_k, r_k = np.asarray(trained[k]).reshape(-1), np.asarray(received[k]).reshape(-1)
            if dtypes[k] == "float64" and buf.dtype == np.float32:  # the difference in float64, then rounded
                with np.errstate(over="ignore", invalid="ignore"):
                    seg[...] = np.subtract(t_k, r_k, dtype=np.float64)
            else:
                np.subtract(t_k, r_k, out=seg, dtype=buf.dtype, casting="unsafe")
            off += sizes[k]
        t = torch.from_numpy(buf)
        # One finiteness check of the update (a finite sum proves every entry finite), before any residual moves.
        if t.numel() and not bool(torch.isfinite(t.sum())) and not bool(torch.isfinite(t).all()):
            _raise_not_finite(members, trained, received, units, ukey)
        buffers[ukey] = t.reshape(np.shape(received[ukey])) if ukey != MODEL_KEY else t
    if local_dp is not None:
        clip_and_noise_(list(buffers.values()), local_dp.clipping_norm, local_dp.noise_multiplier, secure_generator())
    update_sq: dict[str, float] = {}  # of what is sent: under local DP, of the noisy update
    for ukey, members, _ in units:
        for k, s in zip(members, torch.split(buffers[ukey].reshape(-1), [sizes[k] for k in members])):
            update_sq[k] = float(torch.linalg.vector_norm(s)) ** 2 if s.numel() else 0.0

    payloads: dict[str, bytes] = {}
    states = unflatten_states(residuals)  # residual (+ DGC momentum, codec memory) per payload key
    if codec.error_feedback:  # a warm-up codec or rule may have grouped the payloads otherwise last round
        states, dropped = replan_states(states, units, {k: tuple(np.shape(received[k])) for k in float_keys})
        for skey in dropped:
            log(WARNING, "fedcomp: saved state of '%s' does not fit the model's parameters: starting from zero", skey)
    new_states: dict[str, dict[str, np.ndarray]] = {}
    layer_sq_err: dict[str, float] = {}
    layer_sq_norm: dict[str, float] = {}
    used_density, saturated, lost = 1.0, 0, 0.0  # 1.0: a dense codec sends every entry
    for ukey, members, name in units:
        x = buffers.pop(ukey)
        seg_sizes = [sizes[k] for k in members]
        if ukey in wide_units:  # exact float64: nothing to feed back; a residual left by a lossy codec is sent now
            prev = states.get(ukey, {}).get("residual") if codec.error_feedback else None
            if prev is not None and tuple(prev.shape) == tuple(x.shape):
                x += torch.as_tensor(np.asarray(prev)).to(torch.float64)
            payloads[ukey] = codec.build(seed=seed, compressor=name).compress(x)
            norms = [float(torch.linalg.vector_norm(s)) ** 2 for s in torch.split(x.reshape(-1), seg_sizes)]
            for k, n2 in zip(members, norms):
                layer_sq_norm[k], layer_sq_err[k] = n2, 0.0
            new_states[ukey] = {}
            continue
        prev = states.get(ukey, {}).get("residual") if codec.error_feedback else None
        if prev is not None and tuple(prev.shape) != tuple(x.shape):
            log(WARNING, "fedcomp: residual for '%s' has shape %s, the update %s: starting from zero", ukey,
                tuple(prev.shape), tuple(x.shape))
            prev = None
        density = None
        if name == codec.compressor and name in SPARSE_CODECS:
            density = codec.density
            if codec.density_schedule == "adaptive":
                # what is compressed: update + residual (classic EF), update - estimate (EF21)
                v = x if prev is None else x + torch.as_tensor(prev).float() * (-1.0 if codec.error_feedback == "ef21"
                                                                              else 1.0)
                density = adaptive_density(v, name, codec.target_error, codec.density_min, codec.density_max)
            used_density = density
        compressor = codec.build(seed=seed, compressor=name, density=density)
        if codec.error_feedback:
            ef = (EF21(compressor, residual_dtype=codec.residual_dtype) if codec.error_feedback == "ef21" else
                  ErrorFeedback(compressor, residual_dtype=codec.residual_dtype, momentum=codec.momentum_correction))
            for entry in ef.set_state(states.get(ukey, {}), shape=tuple(x.shape), copy=False):
                if entry != "residual":  # the residual's mismatch was logged above
                    log(WARNING, "fedcomp: saved %s for '%s' has another shape: starting from zero", entry, ukey)
            payloads[ukey] = ef.compress(x, inplace=True, segments=seg_sizes)
            new_states[ukey] = ef.get_state(copy=False)
            norms, errs = ef.last_segment_sq_norms, ef.last_segment_sq_errors
            saturated, lost = saturated + ef.last_saturated, max(lost, ef.last_saturated_loss)
        else:
            payloads[ukey] = compressor.compress(x)
            flat = x.reshape(-1)
            norms = [float(torch.linalg.vector_norm(s)) ** 2 for s in torch.split(flat, seg_sizes)]
            sparse = decompress_sparse(payloads[ukey], max_numel=max(x.numel(), 1))
            if sparse is not None:
                flat[torch.from_numpy(sparse[0])] -= torch.from_numpy(sparse[1])
            else:
                flat -= decompress(payloads[ukey], max_numel=max(x.numel(), 1)).reshape(-1)
            errs = [float(torch.linalg.vector_norm(s)) ** 2 for s in torch.split(flat, seg_sizes)]
        for k, n2, e2 in zip(members, norms, errs):
            layer_sq_norm[k], layer_sq_err[k] = n2, e2
    exact_bytes = sum(np.asarray(received[k]).nbytes for k in exact_keys)
    payloads.update(exact_payloads)
    sq_err, sq_norm = sum(layer_sq_err.values()), sum(layer_sq_norm.values())
    if codec.error_feedback is True and codec.residual_dtype == "fp32":
        res_sq = sq_err  # an fp32 residual is the compression error itself: no extra pass
    else:
        res_sq = sum(float(torch.linalg.vector_norm(torch.from_numpy(st["residual"]).float())) ** 2
                     for st in new_states.values() if "residual" in st)
    new_res = flatten_states(new_states)
    stats: dict[str, Any] = {
        "upload-bytes": float(sum(len(p) for p in payloads.values())),
        "dense-bytes": float(4 * sum(sizes.values()) + exact_bytes),
        "compression-error": (sq_err / sq_norm) ** 0.5 if sq_norm > 0 else 0.0,
        "residual-norm": res_sq**0.5,
        "density": float(used_density),
        "residual-saturated": float(saturated), "residual-saturated-loss": lost,  # fp16 residual clamp
        "layer-update-norm": [update_sq[k] ** 0.5 for k in float_keys],
        "layer-compression-error": [(layer_sq_err[k] / layer_sq_norm[k]) ** 0.5 if layer_sq_norm[k] > 0 else 0.0
                                    for k in float_keys],
    }
    return payloads, new_res, stats


__all__ = ["CompositionError", "adaptive_density", "compress_update", "plan_units", "secure_generator"]
