"""Decoding one client's compressed reply into dense weights (Flower types in, numpy out)."""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord

from ..compression import PayloadError, codec_name, decompress
from ..protocol import MODEL_KEY, PAYLOAD_STYPE


def decode_update(record: ArrayRecord, global_arrays: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict]:
    """Rebuild a client's dense weights ``global + decoded delta`` from its payload record.

    Parameters
    ----------
    record : ArrayRecord
        The reply's ArrayRecord: fedcomp payloads under parameter names, plus optionally one
        under ``MODEL_KEY`` holding the flattened update of every parameter not sent on its
        own, concatenated in the global model's key order.
    global_arrays : dict of str to np.ndarray
        The global weights this client was sent (keys in model order).

    Returns
    -------
    (weights, info)
        Dense weights under the global keys, each of the global dtype and shape; and
        ``{"upload-bytes": int, "codecs": {codec name: bytes}}`` measured from the payloads.

    Raises
    ------
    PayloadError
        A key missing or extra, an Array that is not a fedcomp payload (with a hint to add
        ``compression_mod``), a payload larger in elements or of another shape than its
        parameter, any malformed payload, or a non-finite result.
    """
    keys, expected = list(record.keys()), list(global_arrays)
    individual = [k for k in keys if k != MODEL_KEY]
    unknown = sorted(set(individual) - set(expected))
    covered = [k for k in expected if k not in set(individual)] if MODEL_KEY in keys else []
    missing = sorted(set(expected) - set(individual) - set(covered))
    if unknown or missing:
        raise PayloadError(f"reply keys differ from the model's: missing {missing[:5]}, unexpected {unknown[:5]}")
    if MODEL_KEY in keys and not covered:
        raise PayloadError(f"reply has a '{MODEL_KEY}' payload but every parameter was also sent on its own")
    weights: dict[str, np.ndarray] = {}
    codecs: dict[str, int] = {}
    for key in individual:
        g = global_arrays[key]
        data = _payload_bytes(record[key], key)
        delta = decompress(data, max_numel=max(g.size, 1), expected_shape=tuple(g.shape))
        weights[key] = _apply(key, g, delta.numpy())
        name = codec_name(data)
        codecs[name] = codecs.get(name, 0) + len(data)
    if covered:
        data = _payload_bytes(record[MODEL_KEY], MODEL_KEY)
        total = sum(global_arrays[k].size for k in covered)
        flat = decompress(data, max_numel=max(total, 1), expected_shape=(total,)).numpy()
        off = 0
        for key in covered:
            g = global_arrays[key]
            weights[key] = _apply(key, g, flat[off : off + g.size])
            off += g.size
        name = codec_name(data)
        codecs[name] = codecs.get(name, 0) + len(data)
    return {k: weights[k] for k in expected}, {"upload-bytes": sum(codecs.values()), "codecs": codecs}


def _payload_bytes(arr, key: str) -> bytes:
    if arr.stype != PAYLOAD_STYPE:
        raise PayloadError(
            f"'{key}' is a dense '{arr.stype}' array, not a fedcomp payload: add compression_mod as the FIRST "
            "mod of the ClientApp (mods=[compression_mod, ...])"
        )
    return arr.data


def _apply(key: str, g: np.ndarray, delta: np.ndarray) -> np.ndarray:
    w = g.astype(np.float32) + delta.reshape(g.shape)
    if not np.isfinite(w).all():
        raise PayloadError(f"'{key}': global + update is not finite")
    return w.astype(g.dtype) if np.issubdtype(g.dtype, np.floating) else np.rint(w).astype(g.dtype)
