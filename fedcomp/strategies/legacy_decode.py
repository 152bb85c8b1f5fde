"""Decoding the results of Flower's legacy API: a ``FitRes``' payloads (1-D ``uint8`` arrays from
[`fedcomp.client.numpy_client.CompressedNumPyClient`][], or raw tensors of type ``fedcomp.payload.v1`` from
``compression_mod`` in a legacy ``ClientApp``), read without pickle, and the client's dense weights rebuilt
from them (`decode_legacy_update`: `fedcomp.strategies.decode.decode_update`'s checks)."""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord
from flwr.common import Parameters

from fedcomp.compression import PayloadError, parse_header
from fedcomp.download.legacy import uint8_npy_body
from fedcomp.protocol.messages import MODEL_KEY, PAYLOAD_STYPE, payload_array
from fedcomp.strategies.decode import decode_update

#: ``Parameters.tensor_type`` Flower gives to ``np.save``-serialized ndarrays.
NUMPY_TENSOR_TYPE = "numpy.ndarray"


def payloads_from_parameters(parameters: Parameters) -> list[bytes]:
    """Extract the fedcomp payloads a client sent in a legacy ``FitRes``.

    Parameters
    ----------
    parameters : flwr.common.Parameters
        Either ``tensor_type == "numpy.ndarray"`` with every tensor a 1-D ``uint8`` array
        (from ``CompressedNumPyClient``; only the ``.npy`` header is parsed, never pickle), or
        ``tensor_type == "fedcomp.payload.v1"`` with raw payload bytes (from
        ``compression_mod`` in a legacy ``ClientApp``).

    Returns
    -------
    list of bytes
        The payloads in the order the client sent them.

    Raises
    ------
    PayloadError
        Another tensor type, or an array that is not 1-D ``uint8`` (a dense reply: the
        message says to wrap the client in ``CompressedNumPyClient``).
    """
    if parameters.tensor_type == PAYLOAD_STYPE:
        return [bytes(t) for t in parameters.tensors]
    if parameters.tensor_type != NUMPY_TENSOR_TYPE:
        raise PayloadError(f"unsupported tensor type {parameters.tensor_type!r} in the fit result")
    return [uint8_npy_body(t, i) for i, t in enumerate(parameters.tensors)]


def decode_legacy_update(payloads: list[bytes], global_arrays: list[np.ndarray]) -> tuple[list[np.ndarray], dict]:
    """Rebuild a client's dense weights ``global + decoded delta`` from its payloads.

    One payload per array (selection "tensor") or one for the whole flattened model
    (selection "model"); told apart by their number and, for a one-array model, by the
    shape in the payload header. Validation is `fedcomp.strategies.decode_update`'s:
    each payload may claim at most the elements of its array and must have its shape.

    Parameters
    ----------
    payloads : list of bytes
        From `payloads_from_parameters`.
    global_arrays : list of np.ndarray
        The global weights this client was sent.

    Returns
    -------
    (weights, info)
        Dense arrays in the global order, dtypes and shapes; ``info`` as ``decode_update``'s
        (``upload-bytes``, ``codecs``).

    Raises
    ------
    PayloadError
        Wrong number of payloads, or any payload ``decode_update`` rejects.
    """
    keys = [str(i) for i in range(len(global_arrays))]
    if len(payloads) == len(keys) and not (len(keys) == 1 and _is_flat_model_payload(payloads[0], global_arrays[0])):
        names = keys
    elif len(payloads) == 1:
        names = [MODEL_KEY]
    else:
        raise PayloadError(f"expected {len(keys)} payloads (one per array) or 1 (whole model), got {len(payloads)}")
    record = ArrayRecord(
        {n: payload_array(p) for n, p in zip(names, payloads)}
    )
    weights, info = decode_update(record, dict(zip(keys, global_arrays)))
    return [weights[k] for k in keys], info


def _is_flat_model_payload(payload: bytes, g: np.ndarray) -> bool:
    """True when a lone payload is the whole-model form ``(g.size,)`` of a multi-dim ``g``."""
    shape = tuple(parse_header(payload, max_numel=max(g.size, 1)).shape)
    return shape != tuple(g.shape) and shape == (g.size,)


__all__ = ["NUMPY_TENSOR_TYPE", "decode_legacy_update", "payloads_from_parameters"]
