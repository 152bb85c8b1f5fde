"""The planning stage of a client update: which tensors travel in which payload, with which codec.

`plan_update` checks the trained weights against the received ones and lays out the
payloads (`plan_units`: per-layer rules, small tensors, BatchNorm policy, one whole-model
payload for the default codec); `density_rule` gives each payload's sparse-codec density
(fixed, or measured by `adaptive_density`). Flower-free apart from the names of the protocol.
"""

from __future__ import annotations

import fnmatch

import numpy as np
import torch

from fedcomp.compression import CODECS
from fedcomp.compression.feedback_pass import Density, Unit
from fedcomp.config import CodecConfig
from fedcomp.config.model_policy import batchnorm_affine_keys
from fedcomp.download.layout import is_batchnorm_stat
from fedcomp.protocol.errors import CompositionError
from fedcomp.protocol.messages import MODEL_KEY
from fedcomp.statedict import is_float_dtype


def plan_units(shapes: dict[str, tuple[int, ...]], codec: CodecConfig) -> list[tuple[str, list[str], str]]:
    """Group float parameters into payloads: ``[(payload key, member parameter names, codec name), ...]``.

    Per parameter, in order: the first ``layer-codecs`` rule whose pattern matches its name;
    else ``small-tensor-compressor`` if it has fewer than ``min-compress-numel`` elements;
    else the default ``compressor``. BatchNorm statistics (`is_batchnorm_stat`) get their own
    payload with `CodecConfig.batchnorm_stats_codec` (``sign`` under ``batchnorm-stats =
    "auto"`` with a lossy codec and error feedback, else ``small-tensor-compressor``; with the
    rest under "codec"), and BatchNorm's affine parameters go ``small-tensor-compressor`` with a sparse codec
    (stc, topk, randomk) while ``batchnorm-affine = "small"``
    (`fedcomp.config.model_policy.batchnorm_affine_keys`). Default-codec parameters share one payload under
    ``MODEL_KEY`` (their updates flattened and concatenated in model order) when the scope is
    "model"; every other parameter gets its own payload under its own name. Pass float tensors
    only: integer and bool tensors never join a codec's payload.
    """
    rules = codec.rules
    sparse = CODECS[codec.compressor].sparse
    affine = set(batchnorm_affine_keys(shapes)) if codec.batchnorm_affine == "small" and sparse else set()
    stats_codec = codec.batchnorm_stats_codec()
    default: list[str] = []
    units: list[tuple[str, list[str], str]] = []
    for key, shape in shapes.items():
        rule = next((c for pat, c in rules if fnmatch.fnmatchcase(key, pat)), None)
        n = int(np.prod(shape)) if shape else 1
        if rule is not None:
            units.append((key, [key], rule))
        elif stats_codec is not None and is_batchnorm_stat(key):
            units.append((key, [key], stats_codec))
        elif n < codec.min_compress_numel or key in affine:
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
            raise CompositionError(f"'{key}': received a {dtypes[key]} tensor but the app returned "
                                   f"{np.asarray(t).dtype}")
    return ordered


def plan_update(received: dict, trained: dict, codec: CodecConfig,
                dtypes: dict[str, str] | None) -> tuple[list[Unit], list[str], dict]:
    """Check ``trained`` against ``received`` and lay out the payloads.

    Returns
    -------
    (units, exact_keys, trained)
        The float payload units (`plan_units` order), the integer/bool tensor names (model
        order) and ``trained`` in ``received``'s key order.

    Raises
    ------
    CompositionError
        As `_check_pair`.
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


def density_rule(unit: Unit, codec: CodecConfig) -> Density:
    """The density of a unit's sparse codec: ``density``, or for the adaptive schedule a rule that
    measures it on what is compressed (update + residual; update - estimate with EF21,
    `adaptive_density`); None for the other codecs."""
    if unit.codec != codec.compressor or not CODECS[unit.codec].sparse:
        return None
    if codec.density_schedule != "adaptive":
        return codec.density
    return lambda v: adaptive_density(v, unit.codec, codec.target_error, codec.density_min, codec.density_max)


__all__ = ["CompositionError", "adaptive_density", "density_rule", "plan_units", "plan_update"]
