"""Server-to-client compression: the server broadcasts the change of the global model compressed,
with error feedback, and clients that hold the previous broadcast rebuild the model from it.

Source: Sattler et al., IEEE TNNLS 2019 (STC in both directions with residuals on both sides).

The server keeps the *broadcast model* B (what an up-to-date client holds) and the true global G.
Each round it sends ``C(G - B)`` and sets ``B <- B + decompress(C(G - B))``; the residual
``G - B`` carries everything not yet sent into the next round (error feedback). A client whose
model version is the previous round's gets the payload; a new client, or one that missed rounds,
gets B dense. Clients train from B; their updates are applied to G, so nothing is lost.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from ..compression import decompress, encode_exact
from ..config import CodecConfig
from ..protocol import BASE_VERSION, MODEL_KEY, MODEL_VERSION, PAYLOAD_DTYPE, PAYLOAD_STYPE
from ..statedict import FlatModel


class Downstream:
    """Per-run state of downstream compression (one broadcast model for all clients).

    Float tensors are broadcast as ``C(G - B)`` over their flattened concatenation (model order);
    integer/bool tensors travel exactly (:mod:`fedcomp.compression.exact`) in every payload message.

    Parameters
    ----------
    codec : CodecConfig
        Parameters (density, levels, ...) for the downstream codec.
    compressor : str
        Downstream codec name ("fp16", "stc", ...).
    seed : int
        Seed of stochastic codecs.
    """

    def __init__(self, codec: CodecConfig, compressor: str, seed: int = 0) -> None:
        self.codec, self.compressor, self.seed = codec, compressor, seed
        self.model: FlatModel | None = None  # B: flat float32 + exact tensors
        self.version = 0
        self.node_version: dict[int, int] = {}
        #: version -> flat B (kept for tests and audits of what each version was; last 2 only)
        self.history: dict[int, np.ndarray] = {}
        self.sent_bytes: dict[int, int] = {}

    @property
    def broadcast(self) -> np.ndarray | None:
        """B's float tensors, flat float32 (None before the first round)."""
        return None if self.model is None else self.model.flat

    def prepare(self, server_round: int, arrays: ArrayRecord, messages: list[Message]) -> list[Message]:
        """Advance B to this round's global model and rewrite each message's arrays and config.

        Every message gets its own RecordDict and ArrayRecord (as the real transport gives each
        node its own copy), so a handler that edits its input affects no other client.

        Returns the messages (modified in place): payload or dense arrays per destination node,
        and a per-message ConfigRecord with the version keys.
        """
        target = FlatModel.from_record(arrays)
        payload = None
        if self.model is None:
            self.model = target
        else:
            comp = self.codec.build(seed=self.seed + server_round, compressor=self.compressor)
            payload = comp.compress(torch.from_numpy(target.flat - self.model.flat))
            self.model.flat += decompress(payload, max_numel=max(target.num_float, 1),
                                          expected_shape=(target.num_float,)).numpy()
            self.model.exact = target.exact
        self.version += 1
        self.history = {self.version: self.model.flat.copy(), **{v: b for v, b in self.history.items()
                                                                  if v == self.version - 1}}
        dense = None
        exact = {k: encode_exact(v) for k, v in self.model.exact.items()}
        self.sent_bytes = {}
        for msg in messages:
            # Flower's strategies may share one RecordDict between messages: give each its own.
            msg.content = RecordDict(dict(msg.content.items()))
            node = msg.metadata.dst_node_id
            arr_key = next(iter(msg.content.array_records))
            cfg_key = next(iter(msg.content.config_records), "config")
            cfg = dict(msg.content[cfg_key]) if cfg_key in msg.content else {}
            cfg[MODEL_VERSION] = self.version
            if payload is not None and self.node_version.get(node) == self.version - 1:
                rec = ArrayRecord({MODEL_KEY: _payload_array(payload)})
                for k, p in exact.items():
                    rec[k] = _payload_array(p)
                msg.content[arr_key] = rec
                cfg[BASE_VERSION] = self.version - 1
            else:
                dense = dense or self.model.record(check=False)
                msg.content[arr_key] = ArrayRecord(dict(dense.items()))
            self.sent_bytes[node] = sum(len(a.data) for a in msg.content[arr_key].values())
            msg.content[cfg_key] = ConfigRecord(cfg)
        return messages

    def received(self, node: int) -> None:
        """``node`` replied this round, so it holds the current version."""
        self.node_version[node] = self.version

    def base_record(self) -> dict[str, np.ndarray]:
        """B as dense arrays (what clients train from this round)."""
        return {k: a.numpy() for k, a in self.model.record(check=False).items()}


def _payload_array(payload: bytes) -> Array:
    return Array(dtype=PAYLOAD_DTYPE, shape=(len(payload),), stype=PAYLOAD_STYPE, data=payload)
