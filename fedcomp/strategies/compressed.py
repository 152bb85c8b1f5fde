"""``CompressedStrategy``: a Message-API strategy wrapper that decodes compressed replies."""

from __future__ import annotations

import statistics
from logging import INFO, WARNING
from typing import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from ..compression import PayloadError
from ..config import CodecConfig
from .decode import decode_update


class CompressedStrategy(Strategy):
    """Wrap any Message-API strategy so that clients send compressed updates.

    Like Flower's DP wrappers, it adds one concern and delegates the rest:

    1. ``configure_train``: adds the codec (``compressor``, ``density``, ``levels``,
       ``block-size``, ``value-dtype``, ``error-feedback``, ``residual-dtype``) to the train
       ConfigRecord and remembers the global weights sent in that round.
    2. ``aggregate_train``: decodes every reply produced by
       :func:`fedcomp.client.compression_mod` (validated: shape, size, finiteness),
       rebuilds dense weights = sent global + decoded delta under the original keys, and
       hands ordinary replies to ``inner``. A reply that fails to decode is logged with
       its node id and reason and dropped (``rejected-replies``); error replies are
       counted (``failed-clients``). The global model never sees either.
    3. Adds round metrics: ``upload-bytes`` (sum of payload bytes actually received),
       ``dense-bytes``, ``compression-ratio`` (dense / upload), ``compression-error`` and
       ``residual-norm`` (means over clients), ``download-bytes``, ``num-replies``,
       ``rejected-replies``, ``failed-clients`` and ``upload-bytes-<codec>`` per codec.

    Parameters
    ----------
    inner : Strategy
        Any Message-API strategy: FedAvg, FedAdam, FedProx, Flower's DP wrappers, ...
        It only ever receives dense, validated replies.
    compressor : str
        Codec name (see :func:`fedcomp.compression.available_compressors`). Default "stc".
    error_feedback : bool
        Clients keep a residual (Karimireddy et al. 2019). Default True.
    **params
        Codec parameters by their Python or run-config names: ``density``, ``levels``,
        ``block_size``, ``value_dtype``, ``residual_dtype``.

    Raises
    ------
    ValueError
        Unknown codec or a parameter out of range (at construction).
    """

    def __init__(self, inner: Strategy, compressor: str = "stc", error_feedback: bool = True, **params) -> None:
        if not isinstance(inner, Strategy):
            raise TypeError(f"inner must be a flwr.serverapp.strategy.Strategy, got {type(inner).__name__}")
        mapping = {k.replace("_", "-"): v for k, v in params.items()}
        mapping.update({"compressor": compressor, "error-feedback": error_feedback})
        unknown = set(mapping) - set(CodecConfig().to_mapping())
        if unknown:
            raise TypeError(f"unknown codec parameter(s) {sorted(unknown)}")
        self.inner = inner
        self.codec = CodecConfig.from_mapping(mapping)
        self._sent: dict[int, dict[str, np.ndarray]] = {}
        #: Per-round metrics computed by this wrapper (round -> dict).
        self.history: dict[int, dict[str, float]] = {}

    # -- delegation -------------------------------------------------------------------
    def summary(self) -> None:
        """Log the codec, then the inner strategy's summary."""
        log(INFO, "\t├──> CompressedStrategy: %s", self.codec.describe())
        self.inner.summary()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """Add the codec to ``config``, remember ``arrays``, and delegate."""
        for k, v in self.codec.to_mapping().items():
            config[k] = v
        self._sent = {server_round: {k: a.numpy().copy() for k, a in arrays.items()}}
        return self.inner.configure_train(server_round, arrays, config, grid)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """Delegate unchanged (evaluation messages carry dense global weights)."""
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Delegate unchanged."""
        return self.inner.aggregate_evaluate(server_round, replies)

    # -- the one concern ---------------------------------------------------------------
    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode, validate and rebuild every reply, then let ``inner`` aggregate the dense ones."""
        replies = list(replies)
        sent = self._sent.get(server_round)
        if sent is None:
            raise RuntimeError(f"aggregate_train for round {server_round} without configure_train")
        good: list[Message] = []
        stats: list[dict] = []
        codec_bytes: dict[str, int] = {}
        rejected = failed = 0
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error():
                failed += 1
                log(WARNING, "round %s: client (node %s) failed: %s", server_round, node, reply.error.reason)
                continue
            try:
                good.append(self._decode_reply(reply, sent, stats, codec_bytes))
            except (PayloadError, ValueError, TypeError, KeyError) as exc:
                rejected += 1
                log(WARNING, "round %s: rejected reply from node %s: %s", server_round, node, exc)
        arrays, metrics = (None, None)
        if good:
            arrays, metrics = self.inner.aggregate_train(server_round, good)
        ours = self._round_metrics(stats, codec_bytes, len(good), rejected, failed)
        self.history[server_round] = ours
        merged = dict(metrics) if metrics is not None else {}
        merged.update(ours)
        return arrays, MetricRecord(merged)

    def _decode_reply(self, reply: Message, sent: dict, stats: list, codec_bytes: dict) -> Message:
        recs = reply.content.array_records
        if len(recs) != 1:
            raise PayloadError(f"expected one ArrayRecord in the reply, found {len(recs)}")
        key, record = next(iter(recs.items()))
        weights, info = decode_update(record, sent)
        metric_recs = reply.content.metric_records
        m = dict(next(iter(metric_recs.values()))) if len(metric_recs) == 1 else {}
        for name, nbytes in info["codecs"].items():
            codec_bytes[name] = codec_bytes.get(name, 0) + nbytes
        stats.append({
            "upload-bytes": info["upload-bytes"],
            "dense-bytes": float(sum(4 * w.size for w in weights.values())),
            "compression-error": float(m.get("compression-error", 0.0)),
            "residual-norm": float(m.get("residual-norm", 0.0)),
            "download-bytes": float(m.get("download-bytes", 0.0)),
        })
        reply.content[key] = ArrayRecord({k: Array(np.ascontiguousarray(w)) for k, w in weights.items()})
        return reply

    @staticmethod
    def _round_metrics(stats: list[dict], codec_bytes: dict, n_good: int, rejected: int, failed: int) -> dict:
        up = float(sum(s["upload-bytes"] for s in stats))
        dense = float(sum(s["dense-bytes"] for s in stats))
        out = {
            "upload-bytes": up,
            "dense-bytes": dense,
            "download-bytes": float(sum(s["download-bytes"] for s in stats)),
            "compression-ratio": dense / up if up else 0.0,
            "compression-error": statistics.fmean(s["compression-error"] for s in stats) if stats else 0.0,
            "residual-norm": statistics.fmean(s["residual-norm"] for s in stats) if stats else 0.0,
            "num-replies": n_good,
            "rejected-replies": rejected,
            "failed-clients": failed,
        }
        for name, nbytes in sorted(codec_bytes.items()):
            out[f"upload-bytes-{name}"] = float(nbytes)
        return out
