"""Pieces of the downstream (server-to-client) protocol both sides need (Flower-free).

A downstream message splits a model's float tensors into the *compressed part* (one flat float32
vector, model order, changed by compressed payloads) and the *exempt part* (BatchNorm running
statistics while ``batchnorm-stats = "small"``: sent exactly in every message, like the integer
and bool tensors). The server's :mod:`fedcomp.strategies.downstream_sender` writes messages,
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


__all__ = ["chain_key", "gather", "is_batchnorm_stat", "scatter", "segments", "settle"]
