"""Pieces of the downstream (server-to-client) protocol both sides need (Flower-free).

A downstream message splits a model's float tensors into the *compressed part* (one flat float32
vector, model order, changed by compressed payloads) and the *exempt part* (BatchNorm running
statistics unless ``batchnorm-stats = "codec"``: with "small", sent exactly in every message, like
the integer and bool tensors; with "auto", the default, a node that holds a copy gets each
statistic's change since that copy as a scaled-sign payload under :func:`stat_delta_key`, applied
by :func:`apply_stat_delta` on both sides, so the server knows each node's copy bit for bit). The server's :mod:`fedcomp.strategies.downstream_sender` writes messages,
:mod:`fedcomp.client.downstream_receiver` reads them.
"""

from __future__ import annotations

import numpy as np
import torch

from fedcomp.protocol.messages import MODEL_KEY
from fedcomp.statedict import BF16, FlatModel


def is_batchnorm_stat(key: str) -> bool:
    """True for BatchNorm's float statistics in a state_dict: ``<module>.running_mean`` /
    ``<module>.running_var`` (the names ``torch.nn.modules.batchnorm`` registers)."""
    return key.rsplit(".", 1)[-1] in ("running_mean", "running_var")


#: Prefix of the ArrayRecord key of a BatchNorm statistic's change (``batchnorm-stats = "auto"``).
STAT_DELTA_PREFIX = "fedcomp.stat-delta/"


#: A running variance falls at most to this fraction of its previous value in one lossy exchange (a
#: scaled sign's change is one magnitude per tensor: it can undershoot a small variance to <= 0, and a
#: variance of 0 makes BatchNorm's output ``x / sqrt(eps)``); what is held back arrives in later rounds.
VAR_FLOOR = 0.5


def is_running_var(key: str) -> bool:
    """True for BatchNorm's running variance (``<module>.running_var``): never below zero."""
    return key.rsplit(".", 1)[-1] == "running_var"


def stat_delta_key(key: str) -> str:
    """ArrayRecord key of the change of BatchNorm statistic ``key`` in a downstream message."""
    return STAT_DELTA_PREFIX + key


def apply_stat_delta(model: FlatModel, key: str, change: np.ndarray) -> None:
    """``key``'s values += ``change`` (float32, the tensor's shape or flat) in place: added in float32
    (float64 for a float64 tensor) whatever the model's flat dtype; a running variance then kept at
    >= :data:`VAR_FLOOR` times its previous value (so >= 0: a lossy change can undershoot); then
    rounded to the tensor's dtype (:func:`settle`). The server applies it to its record of a node's
    copy, the node to its copy: the same float operations, so both copies stay equal bit for bit."""
    view = model.float_view(key).reshape(-1)
    wide = np.float64 if model.specs[key].dtype == "float64" else np.float32  # not the flat's: the tensor's
    vec = view.astype(wide) + change.reshape(-1).astype(wide)
    if is_running_var(key):
        np.maximum(vec, view.astype(wide) * VAR_FLOOR, out=vec)
    view[...] = settle(model, [key], vec)


def chain_key(i: int) -> str:
    """ArrayRecord key of the ``i``-th compressed payload of a message (applied in order, from 0)."""
    return MODEL_KEY if i == 0 else f"{MODEL_KEY}/{i}"


def segments(model: FlatModel, keys: list[str]) -> list[tuple[int, int]]:
    """``[(flat offset, numel), ...]`` of float tensors ``keys`` in ``model.flat``."""
    return [(model.offsets[k], model.specs[k].numel) for k in keys]


def gather(model: FlatModel, keys: list[str]) -> np.ndarray:
    """The float32 values of ``keys`` concatenated (a copy), shape ``(sum numel,)``."""
    if keys == model.float_keys:
        return model.flat.copy()
    parts = [model.flat[o: o + n] for o, n in segments(model, keys)]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def scatter(model: FlatModel, keys: list[str], vec: np.ndarray) -> None:
    """Write ``vec`` (what :func:`gather` returns) back into ``model.flat`` in place."""
    off = 0
    for o, n in segments(model, keys):
        model.flat[o: o + n] = vec[off: off + n]
        off += n


def settle(model: FlatModel, keys: list[str], vec: np.ndarray) -> np.ndarray:
    """Round ``vec`` (the float32 values of ``keys``) in place to each tensor's dtype (fp16, bf16),
    as a copy held in the model's own dtypes is; float32/float64 tensors are left as they are.
    Values beyond fp16's range become +-inf here (the caller's cast check refuses them)."""
    off = 0
    for k in keys:
        spec = model.specs[k]
        n = spec.numel
        if spec.dtype == BF16:
            vec[off: off + n] = torch.from_numpy(vec[off: off + n].copy()).to(torch.bfloat16).float().numpy()
        elif spec.dtype == "float16":
            with np.errstate(over="ignore"):
                vec[off: off + n] = vec[off: off + n].astype(np.float16).astype(np.float32)
        off += n
    return vec


__all__ = ["STAT_DELTA_PREFIX", "VAR_FLOOR", "apply_stat_delta", "chain_key", "gather", "is_batchnorm_stat", "is_running_var", "scatter",
           "segments", "settle", "stat_delta_key"]
