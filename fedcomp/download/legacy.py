"""The compressed download on Flower's legacy API (``flwr.server.strategy`` strategies, ``NumPyClient``).

A legacy strategy hands each client a ``FitIns`` / ``EvaluateIns`` whose ``Parameters`` is a list of byte
tensors of one ``tensor_type``; the client's ``NumPyClient`` adapter reads each with ``np.load``. The
download's record (payloads, seeded-init rules, exact tensors, each with its stype, dtype and shape:
`fedcomp.download.sender`) travels as 1-D ``uint8`` arrays, which every legacy client reads without
pickle, and the record's layout (key, stype, dtype, shape of each, in order) as a JSON string in the
config (`LAYOUT_KEY`). The node rebuilds the record (`record_from_legacy`), then the model from its copy
(`fedcomp.download.receiver.rebuild_model`: every check of the Message-API download), and reports the
copy's digest in its reply's metrics (`DIGEST_KEY`; legacy replies carry metrics, not records).

The legacy API names no tensors: they are their positions (``"0"``, ``"1"``, ...), so BatchNorm's
running statistics travel with the rest of the float tensors (integer and bool tensors exactly).

- server: `LegacyDownload` (held by `fedcomp.strategies.legacy_strategy.LegacyCompressedStrategy`);
- client: `rebuild_legacy` (`fedcomp.client.numpy_client.CompressedNumPyClient`) and `expand_legacy_message`
  (`fedcomp.client.compression_mod` in a legacy ``ClientApp(client_fn=...)``).
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, Message, RecordDict
from flwr.common import EvaluateIns, FitIns, Parameters, ndarrays_to_parameters, parameters_to_ndarrays
from numpy.lib import format as npy_format

from fedcomp.compression import PayloadError
from fedcomp.compression.wire import DEFAULT_MAX_NUMEL
from fedcomp.download.receiver import held_copy_digest, rebuild_model
from fedcomp.download.sender import Downstream
from fedcomp.protocol.messages import MODEL_META_KEY, MODEL_STATE_KEY

#: Config key of the download's layout: a JSON list of ``[key, stype, dtype, shape]``, one per array.
LAYOUT_KEY = "fedcomp-download-layout"
#: Metrics key of a legacy reply: the digest of the model copy the node holds (bytes).
DIGEST_KEY = "fedcomp-copy-digest"
#: The key under which Flower's compat layer carries an empty ``Parameters`` (no array: a download with no
#: step for a client that holds the latest broadcast and a model without integer tensors).
FLOWER_EMPTY = "_empty"
#: Longest layout a node reads (characters): about 40 bytes an array, for 100,000 arrays.
MAX_LAYOUT_CHARS = 4_000_000


def positional_record(arrays: list[np.ndarray]) -> ArrayRecord:
    """A legacy model (arrays in order) as a record named by position (``"0"``, ``"1"``, ...)."""
    return ArrayRecord({str(i): Array(np.require(a, requirements="C")) for i, a in enumerate(arrays)})


def record_to_legacy(rec: ArrayRecord) -> tuple[list[np.ndarray], str]:
    """The download's record as legacy arrays (each array's bytes as a 1-D ``uint8`` array) and its layout."""
    layout = [[k, a.stype, a.dtype, [int(d) for d in a.shape]] for k, a in rec.items()]
    return [np.frombuffer(bytes(a.data), np.uint8) for a in rec.values()], json.dumps(layout, separators=(",", ":"))


def record_from_legacy(arrays: list, layout: object) -> ArrayRecord:
    """Inverse of `record_to_legacy`; ``arrays``: 1-D ``uint8`` arrays (or their bytes).

    Raises
    ------
    PayloadError
        A layout that is not a JSON list of ``[key, stype, dtype, shape]`` (distinct string keys, a shape of
        at most 32 dimensions, each >= 0 and at most `DEFAULT_MAX_NUMEL` entries), or over `MAX_LAYOUT_CHARS`;
        another number of arrays than entries, or an array that is not 1-D ``uint8``.
    """
    if not isinstance(layout, str) or len(layout) > MAX_LAYOUT_CHARS:
        raise PayloadError(f"download layout ('{LAYOUT_KEY}') must be a string of at most {MAX_LAYOUT_CHARS} "
                           "characters")
    try:
        entries = json.loads(layout)
    except (ValueError, RecursionError) as err:  # RecursionError: arrays nested thousands deep
        raise PayloadError(f"download layout is not JSON: {err}") from None
    if not isinstance(entries, list) or len(entries) != len(arrays):
        raise PayloadError(f"download layout must list one entry per array ({len(arrays)} arrays)")
    rec, seen = ArrayRecord(), set()
    for entry, arr in zip(entries, arrays):
        if not (isinstance(entry, list) and len(entry) == 4 and all(isinstance(v, str) for v in entry[:3])
                and isinstance(entry[3], list) and len(entry[3]) <= 32
                and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= DEFAULT_MAX_NUMEL
                        for d in entry[3])):
            raise PayloadError(f"download layout entry {str(entry)[:80]} is not [key, stype, dtype, shape]")
        key, stype, dtype, shape = entry
        if key in seen:
            raise PayloadError(f"download layout names '{key[:80]}' twice")
        seen.add(key)
        data = arr if isinstance(arr, bytes) else _uint8_bytes(arr, key)
        rec[key] = Array(dtype=dtype, shape=tuple(shape), stype=stype, data=data)
    return rec


def _uint8_bytes(arr: object, key: str) -> bytes:
    if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.ndim != 1:
        raise PayloadError(f"download array '{key[:80]}' is not a 1-D uint8 array")
    return arr.tobytes()


def uint8_npy_body(tensor: bytes, index: int) -> bytes:
    """The bytes of a ``.npy``-serialized 1-D ``uint8`` array, checked against its header.

    Reads only the ``.npy`` header (``numpy.lib.format``: a literal dict, never pickle) and
    requires ``dtype == uint8``, one dimension and exactly that many bytes after it, so a
    header claiming a huge array allocates nothing.
    """
    fp = io.BytesIO(tensor)
    try:
        version = npy_format.read_magic(fp)
        if version == (1, 0):
            shape, _, dtype = npy_format.read_array_header_1_0(fp)
        elif version == (2, 0):
            shape, _, dtype = npy_format.read_array_header_2_0(fp)
        else:
            raise ValueError(f"unsupported .npy version {version}")
    except ValueError as exc:
        raise PayloadError(f"array {index} is not a readable .npy array: {exc}") from None
    if dtype != np.uint8 or len(shape) != 1:
        raise PayloadError(f"array {index} is a dense {dtype} array of shape {shape}, not fedcomp's bytes (1-D "
                           "uint8): wrap the client in fedcomp.client.numpy_client.CompressedNumPyClient (or run "
                           "compression_mod on the node)")
    body = tensor[fp.tell():]
    if len(body) != shape[0]:
        raise PayloadError(f"array {index}: .npy header claims {shape[0]} bytes, {len(body)} follow")
    return bytes(body)


def rebuild_legacy(state: RecordDict, arrays: list[np.ndarray], config: Mapping) -> list[np.ndarray] | None:
    """The model a legacy download describes, rebuilt from the copy kept in ``state`` (which it replaces),
    as the arrays in order; None when ``config`` carries no download layout (dense weights: ``arrays``).

    Raises
    ------
    PayloadError, CompositionError
        As `record_from_legacy` and `fedcomp.download.receiver.rebuild_model`; the held copy is kept.
    """
    if LAYOUT_KEY not in config:
        return None
    held = {k: state[k] for k in (MODEL_STATE_KEY, MODEL_META_KEY) if k in state}
    rec, _ = rebuild_model(state, record_from_legacy(list(arrays), config[LAYOUT_KEY]), config)
    if list(rec.keys()) != [str(i) for i in range(len(rec))]:
        for k in (MODEL_STATE_KEY, MODEL_META_KEY):  # the held copy stays what it was
            if k in held:
                state[k] = held[k]
            elif k in state:
                del state[k]
        raise PayloadError("a legacy download must name its tensors by position ('0', '1', ...)")
    return [a.numpy() for a in rec.values()]


def expand_legacy_message(msg: Message) -> str | None:
    """In place: a legacy message's download (uint8 arrays and the layout in its config) back to the
    record the Message-API receiver reads; the layout key leaves the config. Returns the ArrayRecord's key
    (None: not a legacy download).

    Raises
    ------
    PayloadError
        An array that is not a 1-D ``uint8`` ``.npy`` (`uint8_npy_body`: its header read, never pickle, no
        allocation from a claimed size), or as `record_from_legacy`.
    """
    content = msg.content
    cfg_key = next((k for k, c in content.config_records.items() if LAYOUT_KEY in c), None)
    if cfg_key is None or len(content.array_records) != 1:
        return None
    arr_key, rec = next(iter(content.array_records.items()))
    blobs = [bytes(a.data) for k, a in rec.items() if not (k == FLOWER_EMPTY and not a.data)]
    arrays = [uint8_npy_body(blob, i) for i, blob in enumerate(blobs)]  # the header only: never pickle
    content[arr_key] = record_from_legacy(arrays, content[cfg_key][LAYOUT_KEY])
    del content[cfg_key][LAYOUT_KEY]
    return arr_key


def copy_digest_metric(state: RecordDict) -> dict[str, bytes]:
    """``{DIGEST_KEY: digest}`` of the copy kept in ``state`` (empty without one), for a legacy reply's metrics."""
    digest = held_copy_digest(state)
    return {} if digest is None else {DIGEST_KEY: digest}


class LegacyDownload:
    """The server side of the legacy API's download (see the module docstring): rewrites the ``FitIns`` and
    ``EvaluateIns`` a legacy strategy made, and notes from the results what each client holds.

    Parameters
    ----------
    downstream : Downstream
        The sender; its ``correction`` must be 0 (a legacy inner strategy gets each result's weights).

    Raises
    ------
    ValueError
        A ``downstream`` with a correction.
    """

    def __init__(self, downstream: Downstream) -> None:
        if downstream.correction:
            raise ValueError("the legacy API's download takes no downstream correction")
        self.downstream = downstream
        #: of the last call of `instructions`: bytes of the model sent to each client (by ``cid``)
        self.sent_bytes: dict[str, int] = {}

    def instructions(self, server_round: int, instructions: list, phase: str) -> list:
        """``(proxy, FitIns or EvaluateIns)`` pairs with each model in its download form.

        Raises
        ------
        ValueError
            Instructions that carry different models (the download sends one global model a round).
        """
        if not instructions:
            return instructions
        models = {id(ins.parameters): ins.parameters for _, ins in instructions}
        first = next(iter(models.values()))
        if any(p.tensors != first.tensors for p in models.values()):
            raise ValueError("the compressed download sends one global model a round, but the strategy's "
                             f"{phase} instructions carry different models")
        target = positional_record(parameters_to_ndarrays(first))
        nodes = [proxy.cid for proxy, _ in instructions]
        forms = self.downstream.prepare_nodes(server_round, target, nodes, [dict(ins.config) for _, ins in
                                                                            instructions], phase)
        self.sent_bytes = {n: int(b) for n, b in self.downstream.sent_bytes.items()}
        out = []
        for (proxy, ins), (rec, cfg) in zip(instructions, forms):
            arrays, layout = record_to_legacy(rec)
            params: Parameters = ndarrays_to_parameters(arrays)
            kind = FitIns if phase == "train" else EvaluateIns
            out.append((proxy, kind(params, {**cfg, LAYOUT_KEY: layout})))
        return out

    def note(self, results: list, failures: list) -> set[str]:
        """Each client that answered holds what it was sent if the digest it reports says so; one that
        failed, or reports none, is forgotten (a first contact next time). The digest leaves the metrics.
        Returns the clients (``cid``) sent a download whose result reports no digest: a client without
        fedcomp, which read the download's bytes as its model (their results must not count)."""
        digests = {}
        for proxy, res in results:
            metrics = res.metrics if res.metrics is not None else {}
            digest = metrics.pop(DIGEST_KEY, None)
            digests[proxy.cid] = digest if isinstance(digest, bytes) else b""
        for failure in failures:
            if isinstance(failure, tuple):
                digests[failure[0].cid] = b""
        for node, digest in digests.items():
            if node in self.sent_bytes:
                self.downstream.received(node, digest)
        return {proxy.cid for proxy, _ in results if proxy.cid in self.sent_bytes and not digests[proxy.cid]}


__all__ = ["DIGEST_KEY", "LAYOUT_KEY", "LegacyDownload", "copy_digest_metric", "expand_legacy_message",
           "positional_record", "rebuild_legacy", "record_from_legacy", "record_to_legacy", "uint8_npy_body"]
