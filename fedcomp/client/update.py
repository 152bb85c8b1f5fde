"""From trained weights to payloads: ``delta = trained - received`` -> (local DP) -> error feedback -> encode.

Flower-free apart from the names of the protocol; used by ``compression_mod`` and the legacy
``CompressedNumPyClient``. Float tensors become updates compressed by the codec (one payload per
tensor, or one for the whole model with selection "model"); integer and bool tensors travel
exactly (`fedcomp.compression.exact`), except under local DP, where they are not sent at all.

The stages, in the order the data flows (`compress_update` runs them): `plan_update`
(`plan`) -> `encode_exact_tensors` -> `restore_states` -> (local DP:
`write_deltas`, `privatize`) -> `encode_units` (one
`fedcomp.compression.feedback_pass.feedback_pass` per payload) -> `summarize`.
"""

from __future__ import annotations

from logging import WARNING
from typing import Any

import numpy as np
import torch
from flwr.common.logger import log

# CompositionError, adaptive_density and plan_units are also imported from here by older callers
from fedcomp.client.clip_bound import encode_within_norm
from fedcomp.client.plan import CompositionError, adaptive_density, density_rule, plan_units, plan_update
from fedcomp.client.replan import replan_states
from fedcomp.compression import encode_exact, flatten_states, unflatten_states
from fedcomp.compression.error_feedback import RESIDUAL, segment_sq_norms
from fedcomp.compression.feedback_pass import Unit, UnitResult, feedback_pass, write_delta
from fedcomp.config import CodecConfig
from fedcomp.privacy import LocalDP, clip_and_noise_, secure_generator
from fedcomp.statedict import exact_cast, is_float_dtype


def encode_exact_tensors(keys: list[str], received: dict, trained: dict) -> dict[str, bytes]:
    """Integer and bool tensors as exact payloads in the model's own dtype (run first: a value that
    does not fit fails before any state moves).

    Raises
    ------
    ValueError
        A value outside the model's dtype (`fedcomp.statedict.exact_cast`: never wrapped).
    """
    return {k: encode_exact(exact_cast(k, trained[k], np.asarray(received[k]).dtype)) for k in keys}


def restore_states(residuals: dict[str, np.ndarray], units: list[Unit], codec: CodecConfig,
                   shapes: dict[str, tuple[int, ...]]) -> dict[str, dict[str, np.ndarray]]:
    """Saved client state per payload key (`fedcomp.compression.unflatten_states`), regrouped for
    this round's plan when error feedback is on (`fedcomp.client.replan.replan_states`; what does
    not fit is dropped with a warning and restarts at zero)."""
    states = unflatten_states(residuals)
    if codec.error_feedback:  # a warm-up codec or rule may have grouped the payloads otherwise last round
        states, dropped = replan_states(states, [(u.key, u.members, u.codec) for u in units], shapes)
        for skey in dropped:
            log(WARNING, "fedcomp: saved state of '%s' does not fit the model's parameters: starting from zero", skey)
    return states


def write_deltas(units: list[Unit], received: dict, trained: dict,
                 dtypes: dict[str, str]) -> dict[str, tuple[torch.Tensor, list[float]]]:
    """Every unit's update ``trained - received`` (`fedcomp.compression.feedback_pass.write_delta`,
    finiteness checked) before any is encoded: local DP clips the whole model's update at once."""
    return {u.key: write_delta(u, received, trained, dtypes)[:2] for u in units}


def privatize(buffers: list[torch.Tensor], local_dp: LocalDP) -> None:
    """Local DP in place: clip the whole float update (all buffers together) to the clipping norm and
    add Gaussian noise from the OS CSPRNG (`fedcomp.privacy.clip_and_noise_`)."""
    clip_and_noise_(buffers, local_dp.clipping_norm, local_dp.noise_multiplier, secure_generator())


def encode_units(units: list[Unit], states: dict[str, dict[str, np.ndarray]], codec: CodecConfig,
                 seed: int | None, pair: tuple[dict, dict, dict[str, str]] | None = None,
                 deltas: dict[str, tuple[torch.Tensor, list[float]]] | None = None) -> dict[str, UnitResult]:
    """One `fedcomp.compression.feedback_pass.feedback_pass` per unit, in plan order: from
    ``pair`` (trained, received, dtypes; the residual is added in the delta's own pass where it can
    be) or from the noisy ``deltas`` of `privatize` (consumed). Saved state of another shape
    is logged and restarts at zero.

    Raises
    ------
    ValueError
        As `compress_update`.
    """
    results: dict[str, UnitResult] = {}
    for u in units:
        def build(density: float | None, u: Unit = u):
            return codec.build(seed=seed, compressor=u.codec, density=density)

        results[u.key] = feedback_pass(u, states.get(u.key, {}), build, codec, pair=pair,
                                       delta=None if deltas is None else deltas.pop(u.key),
                                       density=density_rule(u, codec), on_drop=_drop_logger(u))
    return results


def _drop_logger(unit: Unit):
    """Log a saved state entry of ``unit`` dropped for its shape."""
    def on_drop(entry: str, saved_shape: tuple[int, ...]) -> None:
        if entry == RESIDUAL:
            log(WARNING, "fedcomp: residual for '%s' has shape %s, the update %s: starting from zero", unit.key,
                saved_shape, tuple(unit.shape))
        else:
            log(WARNING, "fedcomp: saved %s for '%s' has another shape: starting from zero", entry, unit.key)
    return on_drop


def summarize(units: list[Unit], results: dict[str, UnitResult], payloads: dict[str, bytes],
              update_sq: dict[str, float], exact_bytes: int, density: float, codec: CodecConfig) -> dict[str, Any]:
    """The reply's statistics (see `compress_update`, Returns) from the units' results."""
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


def chunked_sq_norm(a: np.ndarray, chunk: int = 1 << 20) -> float:
    """Squared L2 norm of any float array ``a`` (any shape; fp16/bf16/fp32/fp64), accumulated in fp32 (fp64 for
    fp64) over flat chunks of ``chunk`` entries, so an fp16 residual is never copied whole to fp32 (at most
    ``chunk`` entries, 4 MiB, at a time). Returns a Python float (units of ``a`` squared)."""
    flat = torch.from_numpy(np.ascontiguousarray(a)).reshape(-1)
    wide = torch.float64 if flat.dtype == torch.float64 else torch.float32
    return sum(float(torch.linalg.vector_norm(flat[i:i + chunk].to(wide))) ** 2 for i in range(0, flat.numel(), chunk))


def in_position_order(keys) -> list[str]:
    """Payload keys of a legacy result in the order its arrays travel: the whole-model payload first, then
    each tensor's by its position (``"0"``, ``"1"``, ...), which is how the server reads them back
    (`fedcomp.strategies.legacy_decode.decode_legacy_update`): `compress_update` returns the float
    tensors' payloads before the integer and bool tensors'."""
    return sorted(keys, key=lambda k: (k.isdigit(), int(k) if k.isdigit() else 0))


def compress_update(
    received: dict[str, np.ndarray], trained: dict[str, np.ndarray], codec: CodecConfig,
    residuals: dict[str, np.ndarray], seed: int | None = None, local_dp: LocalDP | None = None,
    dtypes: dict[str, str] | None = None, clipping_norm: float | None = None,
) -> tuple[dict[str, bytes], dict[str, np.ndarray], dict[str, Any]]:
    """Compress ``trained - received`` with error feedback: float tensors per parameter or as one
    model vector, integer/bool tensors exactly.

    Stages: `plan_update` -> `encode_exact_tensors` -> `restore_states` ->
    (local DP: `write_deltas`, `privatize`) -> `encode_units` (per unit the update,
    finiteness checked, error feedback and the codec in one
    `fedcomp.compression.feedback_pass.feedback_pass`) -> `summarize`.

    Parameters
    ----------
    received, trained : dict of str to np.ndarray
        Global weights as received and the locally trained weights; the same keys (``trained``
        may list them in another order) and shapes. bf16 tensors as float32 values.
    codec : CodecConfig
        Codec, per-layer policy, adaptive density and error-feedback settings.
    residuals : dict of str to np.ndarray
        Client state from earlier rounds as `fedcomp.compression.flatten_states` lays it
        out (may be empty): the residual under its payload key, DGC's momentum and codec memory
        such as PowerSGD's Q under ``"<payload key>#<entry>"``; entries of another shape are
        ignored (they restart at 0). Saved under another payload plan (a warm-up codec, a
        per-layer rule), residual and momentum are regrouped per parameter for this round's
        plan (`fedcomp.client.replan.replan_states`), so nothing sent is lost.
    seed : int, optional
        Seed of stochastic codecs (qsgd, int8, randomk). Never used for privacy noise.
    local_dp : LocalDP, optional
        Clip the whole float update and add Gaussian noise drawn from the OS CSPRNG first, before
        error feedback and compression (so every selection is made on the noisy update, and the
        residual is kept of the noisy vector). Integer and bool tensors are then not sent at all
        (an exact counter such as ``num_batches_tracked`` would reveal the number of local batches).
    dtypes : dict of str to str, optional
        The model's dtype names (``"bfloat16"`` for bf16); default: ``received``'s numpy dtypes.
    clipping_norm : float, optional
        Flower's client-side ``clipping_norm`` (the server's noise assumes every update has at most
        this L2 norm): the payloads are decoded here and, where a lossy codec made the decoded
        update longer, the update is encoded again scaled down until it meets the bound
        (`fedcomp.client.clip_bound.encode_within_norm`).

    Returns
    -------
    (payloads, new_residuals, stats)
        Payload bytes per payload key (see `plan_units`; integer/bool tensors under their
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
        a value outside the model's dtype (`fedcomp.statedict.exact_cast`: never wrapped);
        A ``clipping_norm`` the codec cannot meet (e.g. an error-feedback residual longer than it).
    """
    dtypes = dtypes or {k: str(np.asarray(v).dtype) for k, v in received.items()}
    units, exact_keys, trained = plan_update(received, trained, codec, dtypes)
    exact_payloads = {} if local_dp is not None else encode_exact_tensors(exact_keys, received, trained)
    float_keys = [k for k in received if is_float_dtype(dtypes[k])]
    states = restore_states(residuals, units, codec, {k: tuple(np.shape(received[k])) for k in float_keys})
    if local_dp is None and clipping_norm is None:  # classic error feedback: the residual is added in the delta's pass
        results = encode_units(units, states, codec, seed, pair=(trained, received, dtypes))
    else:
        deltas = write_deltas(units, received, trained, dtypes)
        if local_dp is not None:
            privatize([x for x, _ in deltas.values()], local_dp)
            deltas = {u.key: (deltas[u.key][0], segment_sq_norms(deltas[u.key][0].reshape(-1), u.sizes))
                      for u in units}  # the norms of the noisy update
        if clipping_norm is None:
            results = encode_units(units, states, codec, seed, deltas=deltas)
        else:
            results = encode_within_norm(lambda d: encode_units(units, states, codec, seed, deltas=d), deltas, units,
                                         clipping_norm, codec.compressor)
    update_sq = {k: n2 for u in units for k, n2 in zip(u.members, results[u.key].update_sq_norms)}
    update_sq = {k: update_sq[k] for k in received if k in update_sq}  # model order
    # the density of the last sparse payload; a dense codec sends every entry
    used_density = next((r.density for r in reversed(results.values()) if r.density is not None), 1.0)
    payloads = {key: r.payload for key, r in results.items()}
    payloads.update(exact_payloads)
    exact_bytes = sum(np.asarray(received[k]).nbytes for k in exact_keys)
    stats = summarize(units, results, payloads, update_sq, exact_bytes, used_density, codec)
    return payloads, flatten_states({key: r.state for key, r in results.items()}), stats


__all__ = ["CompositionError", "Unit", "UnitResult", "adaptive_density", "compress_update", "encode_exact_tensors",
           "encode_units", "plan_units", "plan_update", "privatize", "restore_states", "summarize", "write_deltas"]
