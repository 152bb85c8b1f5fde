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

from ..compression import decompress
from ..config import CodecConfig
from ..protocol import MODEL_KEY, PAYLOAD_DTYPE, PAYLOAD_STYPE

#: Train-config keys: the version a client will hold after this message, and (payload messages
#: only) the version the payload applies to.
MODEL_VERSION = "fedcomp-model-version"
BASE_VERSION = "fedcomp-base-version"


class Downstream:
    """Per-run state of downstream compression (one broadcast model for all clients).

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
        self.keys: list[str] = []
        self.shapes: dict[str, tuple] = {}
        self.dtypes: dict[str, np.dtype] = {}
        self.broadcast: np.ndarray | None = None  # B, flat float32
        self.version = 0
        self.node_version: dict[int, int] = {}
        #: version -> flat B (kept for tests and audits of what each version was; last 2 only)
        self.history: dict[int, np.ndarray] = {}
        self.sent_bytes: dict[int, int] = {}

    def _flat(self, arrays: ArrayRecord) -> np.ndarray:
        return np.concatenate([arrays[k].numpy().astype(np.float32).ravel() for k in self.keys])

    def _dense_record(self) -> ArrayRecord:
        out, off = ArrayRecord(), 0
        for k in self.keys:
            n = int(np.prod(self.shapes[k])) if self.shapes[k] else 1
            out[k] = Array(np.ascontiguousarray(self.broadcast[off : off + n].reshape(self.shapes[k])))
            off += n
        return out

    def prepare(self, server_round: int, arrays: ArrayRecord, messages: list[Message]) -> list[Message]:
        """Advance B to this round's global model and rewrite each message's arrays and config.

        Returns the messages (modified in place): payload or dense arrays per destination node,
        and a per-message ConfigRecord with the version keys.
        """
        if self.broadcast is None:
            self.keys = list(arrays.keys())
            self.shapes = {k: tuple(arrays[k].shape) for k in self.keys}
            self.broadcast = self._flat(arrays).copy()
            payload = None
        else:
            target = self._flat(arrays)
            comp = self.codec.build(seed=self.seed + server_round, compressor=self.compressor)
            payload = comp.compress(torch.from_numpy(target - self.broadcast))
            self.broadcast = self.broadcast + decompress(payload, max_numel=max(target.size, 1)).numpy()
        self.version += 1
        self.history = {self.version: self.broadcast.copy(), **{v: b for v, b in self.history.items()
                                                                if v == self.version - 1}}
        dense = None
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
                msg.content[arr_key] = ArrayRecord({MODEL_KEY: Array(dtype=PAYLOAD_DTYPE, shape=(len(payload),),
                                                                     stype=PAYLOAD_STYPE, data=payload)})
                cfg[BASE_VERSION] = self.version - 1
                self.sent_bytes[node] = len(payload)
            else:
                dense = dense or self._dense_record()
                msg.content[arr_key] = dense
                self.sent_bytes[node] = sum(len(a.data) for a in dense.values())
            msg.content[cfg_key] = ConfigRecord(cfg)
        return messages

    def received(self, node: int) -> None:
        """``node`` replied this round, so it holds the current version."""
        self.node_version[node] = self.version

    def base_record(self) -> dict[str, np.ndarray]:
        """B as dense arrays (what clients train from this round)."""
        return {k: a.numpy() for k, a in self._dense_record().items()}
