"""What a round costs on the wire: the serialised content of every message, both ways.

A codec's payload is not what a federation pays for. Flower serialises each message's
``RecordDict`` (the arrays with their names, dtypes, shapes and stypes, the config, the metrics) to
protobuf; that is what crosses the network, train and evaluate messages alike, for clients that
fail or are refused as much as for those that are folded. This module counts exactly that,
``flwr.common.serde.recorddict_to_proto(message.content).ByteSize()``, and the same count for what a
plain Flower app would send: the global model as its dense ``ArrayRecord`` where fedcomp sends a
compressed one, the rest of each record as it is (fedcomp's own report metrics left out).

The figures, per round, in bytes (`WireCount`):

- ``wire-bytes-down`` / ``wire-bytes-up``: every message sent to nodes / every reply received, train
  and evaluate;
- ``wire-bytes-train-down``, ``wire-bytes-train-up``, ``wire-bytes-evaluate-down``,
  ``wire-bytes-evaluate-up``: the same by phase;
- ``wire-bytes-fp32``: both ways, what the same messages would have been with the model dense;
- ``wire-ratio``: ``wire-bytes-fp32 / (wire-bytes-down + wire-bytes-up)``.

Error replies carry no content (their bytes count as 0); a node that was sent a message and never
replied costs its download.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.serde import recorddict_to_proto

from fedcomp.download.seeded_init import INIT_SEED
from fedcomp.protocol.messages import BASE_VERSION, COPY_RECORD, MODEL_VERSION, REPORT_KEYS

#: The download's config keys (`fedcomp.download`), which a plain app's messages do not carry.
DOWNLOAD_KEYS = (MODEL_VERSION, BASE_VERSION, INIT_SEED)
#: The phases of a round, in Flower's order.
PHASES = ("train", "evaluate")


def content_bytes(content: RecordDict) -> int:
    """Serialised size of a ``RecordDict`` as Flower's transport carries it (bytes)."""
    return recorddict_to_proto(content).ByteSize()


def message_bytes(msg: Message) -> int:
    """Serialised size of ``msg``'s content (bytes); 0 for an error reply (it carries none)."""
    if msg.has_error() or not msg.has_content():
        return 0
    return content_bytes(msg.content)


class WireCount:
    """The serialised bytes of a strategy's messages, per round and phase, and their fp32 equivalent.

    The fp32 equivalent of a message replaces each of its ArrayRecords by the global model as a dense
    ArrayRecord under the same key (for a train reply: the trained model, the same size), and keeps its
    config records without the download's version keys (`DOWNLOAD_KEYS`) and its metric records without
    fedcomp's report keys (`fedcomp.protocol.messages.REPORT_KEYS`), which a plain Flower app does not
    send; records under the ``protocol`` keys (fedcomp's copy digest, SecAgg+'s own records) count 0. Records
    are serialised independently (protobuf ``map`` entries), so the sum of their sizes is exact.

    Attributes
    ----------
    rounds : dict
        ``{round: {figure: bytes}}`` with the keys named in this module's docstring.
    """

    def __init__(self, protocol: Iterable[str] = ()) -> None:
        self.rounds: dict[int, dict[str, float]] = {}
        #: Records a plain app does not send (fedcomp's copy digest; SecAgg+'s protocol records): counted on
        #: the wire, not in the fp32 equivalent.
        self.protocol = frozenset(protocol) | {COPY_RECORD}
        self._model_bytes: dict[tuple, int] = {}

    def model_record_bytes(self, key: str, arrays: ArrayRecord) -> int:
        """Bytes of ``{key: arrays}`` serialised (the dense model under ``key``), computed once per key
        and model layout."""
        layout = (key, tuple((k, a.dtype, tuple(a.shape)) for k, a in arrays.items()))
        if layout not in self._model_bytes:
            self._model_bytes[layout] = content_bytes(RecordDict({key: arrays}))
        return self._model_bytes[layout]

    def dense_equivalent(self, msg: Message, model: ArrayRecord | None) -> int:
        """Bytes ``msg`` would take in a plain Flower app that sends ``model`` dense (see the class)."""
        if msg.has_error() or not msg.has_content():
            return 0
        total = 0
        for key, record in msg.content.items():
            if key in self.protocol:
                continue
            if isinstance(record, ArrayRecord):
                total += self.model_record_bytes(key, model) if model is not None else content_bytes(
                    RecordDict({key: record}))
            elif isinstance(record, MetricRecord):
                plain = MetricRecord({k: v for k, v in record.items() if k not in REPORT_KEYS})
                total += content_bytes(RecordDict({key: plain}))
            elif isinstance(record, ConfigRecord) and any(k in record for k in DOWNLOAD_KEYS):
                plain = ConfigRecord({k: v for k, v in record.items() if k not in DOWNLOAD_KEYS})
                total += content_bytes(RecordDict({key: plain}))
            else:
                total += content_bytes(RecordDict({key: record}))
        return total

    def _round(self, server_round: int) -> dict[str, float]:
        return self.rounds.setdefault(server_round, {
            "wire-bytes-down": 0.0, "wire-bytes-up": 0.0, "wire-bytes-fp32": 0.0, "wire-ratio": 0.0,
            **{f"wire-bytes-{p}-{d}": 0.0 for p in PHASES for d in ("down", "up")}})

    def _add(self, server_round: int, phase: str, direction: str, messages: Iterable[Message],
             model: ArrayRecord | None) -> None:
        self._round(server_round)
        for msg in messages:
            self.add(server_round, phase, direction, message_bytes(msg), self.dense_equivalent(msg, model))

    def add(self, server_round: int, phase: str, direction: str, nbytes: int, fp32: int) -> None:
        """Count one message of ``phase`` (``direction`` "down" or "up"): ``nbytes`` serialised, ``fp32`` its
        plain-app equivalent (for callers that serialise messages themselves: the legacy API)."""
        r = self._round(server_round)
        r[f"wire-bytes-{phase}-{direction}"] += nbytes
        r[f"wire-bytes-{direction}"] += nbytes
        r["wire-bytes-fp32"] += fp32
        both = r["wire-bytes-down"] + r["wire-bytes-up"]
        r["wire-ratio"] = r["wire-bytes-fp32"] / both if both else 0.0

    def sent(self, server_round: int, phase: str, messages: Iterable[Message], model: ArrayRecord) -> None:
        """Count the messages of ``phase`` sent in ``server_round``; ``model``: the dense global model
        they describe (what a plain app would send instead)."""
        self._add(server_round, phase, "down", messages, model)

    def received(self, server_round: int, phase: str, replies: Iterable[Message],
                 model: ArrayRecord | None) -> None:
        """Count the replies of ``phase`` received in ``server_round`` (error replies as 0 bytes);
        ``model``: the dense model a plain app's reply would carry (None: replies without arrays)."""
        self._add(server_round, phase, "up", replies, model)

    def get(self, server_round: int) -> dict[str, float]:
        """The round's figures (all 0 for a round that sent nothing)."""
        return dict(self._round(server_round))

    def state_dict(self) -> dict[str, dict[str, float]]:
        """``{str(round): figures}`` (JSON-serialisable)."""
        return {str(k): dict(v) for k, v in self.rounds.items()}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict` (missing: nothing counted yet)."""
        self.rounds = {int(k): {f: float(x) for f, x in v.items()} for k, v in (state or {}).items()}


__all__ = ["PHASES", "WireCount", "content_bytes", "message_bytes"]
