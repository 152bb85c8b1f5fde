"""``CompressedStrategy``: a Message-API strategy wrapper that decodes compressed replies."""

from __future__ import annotations

import fnmatch
import statistics
import time
from logging import ERROR, INFO, WARNING
from typing import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from ..compression import PayloadError, available_compressors
from ..config import CodecConfig
from ..privacy import ClientLevelDP, LocalDP
from .decode import decode_update
from .downstream import Downstream


def _num(metrics: dict, key: str, default: float = 0.0) -> float:
    """A client-reported metric as a finite float (untrusted: anything else becomes ``default``)."""
    v = metrics.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
        return default
    return float(v)


def _epsilon(v) -> float | None:
    """A client-reported epsilon: a number >= 0 (inf allowed: no privacy), else None (ignored)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0:
        return None
    return float(v)


def client_seconds(c: dict, uplink_mbps: float | None = None, downlink_mbps: float | None = None) -> float:
    """Simulated seconds of one client's round: compute + upload·8/uplink + download·8/downlink.

    Parameters
    ----------
    c : dict
        A ``client_history`` entry (``train-seconds``, ``compress-seconds``, ``upload-bytes``,
        ``download-bytes``, ``uplink-mbps``, ``downlink-mbps``).
    uplink_mbps, downlink_mbps : float, optional
        Override the client's declared link speeds (megabits per second).
    """
    up = uplink_mbps or c["uplink-mbps"]
    down = downlink_mbps or c["downlink-mbps"]
    compute = c["train-seconds"] + c["compress-seconds"]
    return compute + c["upload-bytes"] * 8 / (up * 1e6) + c["download-bytes"] * 8 / (down * 1e6)


def _wraps(strategy, prefix: str) -> bool:
    """Whether ``strategy`` or a strategy it wraps (``.strategy``/``.inner``) has a class name starting with ``prefix``."""
    for _ in range(8):
        if strategy is None:
            return False
        if type(strategy).__name__.startswith(prefix):
            return True
        strategy = getattr(strategy, "strategy", getattr(strategy, "inner", None))
    return False


def _check_rules_match(codec: CodecConfig, keys: list[str]) -> None:
    """Every ``layer-codecs`` pattern must match at least one parameter name.

    Raises
    ------
    ValueError
        Naming the rule that matches nothing, and the model's parameter names.
    """
    for pattern, name in codec.rules:
        if not any(fnmatch.fnmatchcase(k, pattern) for k in keys):
            raise ValueError(f"run config 'layer-codecs': rule '{pattern}={name}' matches no parameter; "
                             f"parameters are {keys}")


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
       ``rejected-replies``, ``failed-clients``, ``upload-bytes-<codec>`` per codec, and
       ``round-seconds-simulated``: the slowest client's compute time + upload bytes·8 /
       uplink + download bytes·8 / downlink, at the link speeds each client declared
       (node config ``uplink-mbps``/``downlink-mbps``). Client-reported numbers are
       untrusted: non-numbers and non-finite values count as 0.

    Parameters
    ----------
    inner : Strategy
        Any Message-API strategy: FedAvg, FedAdam, FedProx, Flower's DP wrappers, ...
        It only ever receives dense, validated replies.
    compressor : str
        Codec name (see :func:`fedcomp.compression.available_compressors`). Default "stc".
    error_feedback : bool
        Clients keep a residual (Karimireddy et al. 2019). Default True.
    max_num_examples : int
        Largest ``num-examples`` (the inner strategy's weighting key) a reply may claim;
        replies with a non-integer, non-finite, < 1 or larger weight are rejected, so that
        one client cannot dictate or poison the weighted mean. Default 10**9.
    client_dp : ClientLevelDP, optional
        Client-level DP-FedAvg on the decoded updates (clip each, sum / clients sampled, Gaussian
        noise); replaces the inner strategy's averaging and reports ``epsilon`` per round.
    local_dp : LocalDP, optional
        Ask clients to clip and noise their update before compression (sent in the train config).
    max_epsilon : float, optional
        Stop sending rounds before one would push any client's epsilon (client-level, or the
        ``epsilon`` clients report with DP-SGD) past this value.
    downstream : str, optional
        Compress the server-to-client direction too with this codec ("fp16", "stc", ...; None
        or "none": dense). Clients that hold the previous broadcast get ``C(global - broadcast)``
        (server-side error feedback); new or lagging clients get the broadcast model dense.
        Needs ``compression_mod`` on the clients (it rebuilds and keeps the model copy).
    client_sampling : float, optional
        Poisson client sampling: the inner strategy should select every node (fraction 1.0);
        each is then kept independently with this probability q, per round. Needed for
        privacy amplification by sampling in client-level DP (``ClientLevelDP(sample_rate=q)``).
    seed : int, optional
        Seed of the Poisson sampling.
    **params
        Codec parameters by their Python or run-config names: ``density``, ``levels``,
        ``block_size``, ``value_dtype``, ``residual_dtype``.

    Raises
    ------
    ValueError
        Unknown codec or a parameter out of range (at construction).
    """

    def __init__(self, inner: Strategy, compressor: str = "stc", error_feedback: bool = True,
                 max_num_examples: int = 10**9, client_dp: ClientLevelDP | None = None,
                 local_dp: LocalDP | None = None, max_epsilon: float | None = None, downstream: str | None = None,
                 client_sampling: float | None = None, seed: int | None = None, **params) -> None:
        if not isinstance(inner, Strategy):
            raise TypeError(f"inner must be a flwr.serverapp.strategy.Strategy, got {type(inner).__name__}")
        self.inner = inner
        self.codec = CodecConfig.from_kwargs(compressor, error_feedback, **params)
        if self.codec.error_feedback and _wraps(inner, "DifferentialPrivacyClientSide"):
            raise ValueError(
                "error feedback with Flower's client-side clipping breaks the DP guarantee: the residual makes the sent "
                "update's norm exceed clipping_norm from round 2 on, while the server's noise assumes it does not. Use "
                "error_feedback=False, or server-side clipping of the decoded update "
                "(DifferentialPrivacyServerSideFixedClipping inside CompressedStrategy, or client_dp=ClientLevelDP(...))")
        self.max_num_examples = int(max_num_examples)
        self._arr_key = "arrays"
        if downstream not in (None, "none") and downstream not in available_compressors():
            raise ValueError(f"downstream must be 'none' or one of {available_compressors()}, got {downstream!r}")
        self.downstream = None if downstream in (None, "none") else Downstream(self.codec, downstream)
        if client_sampling is not None and not 0.0 < client_sampling <= 1.0:
            raise ValueError(f"client_sampling (Poisson rate) must be in (0, 1], got {client_sampling!r}")
        self.poisson_rate = client_sampling
        self._rng = np.random.default_rng(seed)
        self.client_dp = client_dp
        self.local_dp = local_dp
        self.max_epsilon = max_epsilon
        self.stopped_reason = ""
        self._eps_trace: list[float] = []
        self._eps_next = 0.0
        self._local_rounds = 0
        self._sampled = 0
        self._sent: dict[int, dict[str, np.ndarray]] = {}
        #: Per-round metrics computed by this wrapper (round -> dict).
        self.history: dict[int, dict[str, float]] = {}
        #: Per-round, per-layer means over clients: {name: {"update-norm", "compression-error"}}.
        self.layer_history: dict[int, dict[str, dict[str, float]]] = {}
        self._layer_stats: list[dict] = []
        self._round_codec = self.codec
        #: Per-round, per-client figures (round -> list of dicts with node, bytes, seconds, link speeds).
        self.client_history: dict[int, list[dict]] = {}

    @classmethod
    def from_codec_config(cls, inner: Strategy, codec: CodecConfig, **options) -> "CompressedStrategy":
        """Build from a parsed :class:`fedcomp.config.CodecConfig` (e.g. from the run config);
        ``options`` are the other constructor arguments (``client_dp``, ``max_epsilon``, ...)."""
        params = {k.replace("-", "_"): v for k, v in codec.to_mapping().items()}
        return cls(inner, **params, **options)

    # -- delegation -------------------------------------------------------------------
    def summary(self) -> None:
        """Log the codec, then the inner strategy's summary."""
        log(INFO, "\t├──> CompressedStrategy: %s", self.codec.describe())
        self.inner.summary()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """Add the codec in force (and local-DP settings) to ``config``, remember ``arrays``, delegate.

        Sends nothing (an empty round) once the privacy budget ``max_epsilon`` would be exceeded.
        """
        codec = self.codec.for_round(server_round)
        if server_round == 1:
            _check_rules_match(codec, list(arrays.keys()))
        self.history.setdefault(server_round, {})
        self._sent = {server_round: {k: a.numpy().copy() for k, a in arrays.items()}}
        if self._budget_exhausted(server_round):
            self._sampled = 0
            return []
        for k, v in codec.to_mapping().items():
            config[k] = v
        if self.local_dp is not None:
            config["local-dp-clipping-norm"] = self.local_dp.clipping_norm
            config["local-dp-noise-multiplier"] = self.local_dp.noise_multiplier
        self._round_codec = codec
        msgs = list(self.inner.configure_train(server_round, arrays, config, grid))
        self._sampled = len(msgs)
        if self.poisson_rate is not None:
            # Poisson sampling from the population of connected nodes: each independently with
            # probability q; the divisor of client-level DP is the expected count q * N.
            keep = self._rng.random(len(msgs)) < self.poisson_rate
            self._sampled = self.poisson_rate * len(msgs)
            msgs = [m for m, k in zip(msgs, keep, strict=True) if k]
        if self.downstream is not None and msgs:
            self.downstream.prepare(server_round, arrays, msgs)
        if msgs and len(msgs[0].content.array_records) == 1:
            self._arr_key = next(iter(msgs[0].content.array_records))
        return msgs

    def _budget_exhausted(self, server_round: int) -> bool:
        """True if the next round would push some client past ``max_epsilon`` (logged once)."""
        if self.max_epsilon is None or self.stopped_reason:
            return bool(self.stopped_reason)
        if self.client_dp is not None:
            nxt = self.client_dp.epsilon(self.client_dp.rounds + 1)
        elif self.local_dp is not None:
            nxt = self.local_dp.epsilon(self._local_rounds + 1)
        elif self._eps_next:
            nxt = self._eps_next
        elif len(self._eps_trace) >= 1:
            last = self._eps_trace[-1]
            step = last - (self._eps_trace[-2] if len(self._eps_trace) >= 2 else 0.0)
            nxt = last + step
        else:
            return False
        if nxt > self.max_epsilon:
            self.stopped_reason = (f"privacy budget: round {server_round} would raise epsilon to about {nxt:.3g} > "
                                   f"max-epsilon {self.max_epsilon}; no further rounds are run")
            log(WARNING, "%s", self.stopped_reason)
            return True
        return False

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
        self._layer_stats: list[dict] = []
        self._updates: list[np.ndarray] = []
        codec_bytes: dict[str, int] = {}
        rejected = failed = 0
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error():
                failed += 1
                reason = reply.error.reason or ""
                if "fedcomp.payload" in reason or "clipping_mod expects the keys" in reason:
                    reason += (" (hint: compression_mod must be the first mod of the ClientApp, Flower's DP mods go "
                               "in @app.train(mods=[...]), and the server strategy must be wrapped in CompressedStrategy)")
                log(WARNING, "round %s: client (node %s) failed: %s", server_round, node, reason)
                continue
            try:
                good.append(self._decode_reply(reply, sent, stats, codec_bytes))
                if self.downstream is not None:
                    self.downstream.received(node)
                    stats[-1]["download-bytes"] = float(self.downstream.sent_bytes.get(node, 0))
            except (PayloadError, ValueError, TypeError, KeyError, OverflowError) as exc:
                rejected += 1
                log(WARNING, "round %s: rejected reply from node %s: %s", server_round, node, exc)
        budget = [r for r in replies if r.has_error() and "privacy budget" in (r.error.reason or "")]
        if replies and len(budget) == len(replies) and not self.stopped_reason:
            self.stopped_reason = (f"privacy budget: every client refused round {server_round} (max-epsilon reached); "
                                   "no further rounds are run")
            log(WARNING, "%s", self.stopped_reason)
        arrays, metrics = (None, None)
        # A fixed order (by node id): float sums, and so runs, do not depend on sampling order.
        order = sorted(range(len(good)), key=lambda i: good[i].metadata.src_node_id)
        good = [good[i] for i in order]
        self._updates = [self._updates[i] for i in order] if self._updates else self._updates
        self._common_metric_keys(good)
        dp_info: dict[str, float] = {}
        if good and self.client_dp is not None:
            agg, dp_info = self.client_dp.aggregate(self._updates, max(self._sampled, 1e-12))
            arrays, off = ArrayRecord(), 0
            for k, g in sent.items():
                w = g.astype(np.float32) + agg[off : off + g.size].reshape(g.shape)
                arrays[k] = Array(np.ascontiguousarray(w.astype(g.dtype) if np.issubdtype(g.dtype, np.floating)
                                                       else np.rint(w).astype(g.dtype)))
                off += g.size
        elif good:
            arrays, metrics = self.inner.aggregate_train(server_round, good)
        if arrays is not None and not all(np.isfinite(a.numpy()).all() for a in arrays.values()):
            log(ERROR, "round %s: the aggregated model is not finite; keeping the previous global model",
                server_round)
            arrays = None
        ours = self._round_metrics(stats, codec_bytes, len(good), rejected, failed)
        ours.update(dp_info)
        reported = [s["epsilon"] for s in stats if s["epsilon"] is not None]
        if reported:
            ours["epsilon-max"] = max(reported)
            ours["epsilon-median"] = float(statistics.median(reported))
        if self.local_dp is not None and replies:  # counted once noisy updates may have left the clients
            self._local_rounds += 1
            dp_info["epsilon"] = self.local_dp.epsilon(self._local_rounds)
            ours["epsilon"] = dp_info["epsilon"]
        if "epsilon" in dp_info:
            self._eps_trace.append(dp_info["epsilon"])
        elif reported:
            self._eps_trace.append(max(reported))
        nexts = [s["epsilon-next"] for s in stats if s["epsilon-next"] is not None]
        if nexts:
            self._eps_next = max(nexts)
        self.history[server_round] = ours
        self.client_history[server_round] = stats
        self.layer_history[server_round] = self._layers_mean(list(sent))
        merged = dict(metrics) if metrics is not None else {}
        merged.update(ours)
        return arrays, MetricRecord(merged)

    def _inner_attr(self, name: str, default):
        """An attribute of the innermost strategy (walking Flower's wrappers' ``.strategy``)."""
        obj = self.inner
        for _ in range(8):
            if hasattr(obj, name):
                return getattr(obj, name)
            obj = getattr(obj, "strategy", getattr(obj, "inner", None))
            if obj is None:
                break
        return default

    def _decode_reply(self, reply: Message, sent: dict, stats: list, codec_bytes: dict) -> Message:
        recs = reply.content.array_records
        if len(recs) != 1:
            raise PayloadError(f"expected one ArrayRecord in the reply, found {len(recs)}")
        mrecs = reply.content.metric_records
        if len(mrecs) != 1:
            raise PayloadError(f"expected one MetricRecord in the reply, found {len(mrecs)}")
        m = dict(next(iter(mrecs.values())))
        wkey = self._inner_attr("weighted_by_key", "num-examples")
        n = m.get(wkey)
        if (isinstance(n, bool) or not isinstance(n, (int, float)) or not np.isfinite(n) or n < 1
                or n != int(n) or n > self.max_num_examples):
            raise PayloadError(f"'{wkey}' must be an integer in [1, {self.max_num_examples}], got {n!r}")
        t0 = time.perf_counter()
        weights, info = decode_update(next(iter(recs.values())), sent)
        decode_s = time.perf_counter() - t0
        layers = {k: m.pop(k) for k in ("layer-update-norm", "layer-compression-error") if k in m}
        eps, eps_next = (_epsilon(m.get(k)) for k in ("epsilon", "epsilon-next"))
        if self.client_dp is not None:
            self._updates.append(np.concatenate([(weights[k].astype(np.float32) - sent[k].astype(np.float32)).ravel()
                                                 for k in sent]))
        # Keep only finite scalar metrics: the inner strategy averages them, metrics.json stores them.
        m = {k: v for k, v in m.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)}
        self._layer_stats.append(layers)
        for name, nbytes in info["codecs"].items():
            codec_bytes[name] = codec_bytes.get(name, 0) + nbytes
        stats.append({
            "node": reply.metadata.src_node_id,
            "decode-seconds": decode_s,
            "train-seconds": _num(m, "train-seconds"),
            "compress-seconds": _num(m, "compress-seconds"),
            "uplink-mbps": _num(m, "uplink-mbps", 1.0) if _num(m, "uplink-mbps", 1.0) > 0 else 1.0,
            "downlink-mbps": _num(m, "downlink-mbps", 10.0) if _num(m, "downlink-mbps", 10.0) > 0 else 10.0,
            "residual-bytes": _num(m, "residual-bytes"),
            "upload-bytes": info["upload-bytes"],
            "dense-bytes": float(sum(4 * w.size for w in weights.values())),
            "compression-error": _num(m, "compression-error"),
            "residual-norm": _num(m, "residual-norm"),
            "download-bytes": _num(m, "download-bytes"),
            "density": _num(m, "density"),
            "epsilon": eps,
            "epsilon-next": eps_next,
        })
        # An ordinary reply, in the layout the inner strategy sent: one ArrayRecord, one MetricRecord.
        for key in list(reply.content.keys()):
            del reply.content[key]
        reply.content[self._arr_key] = ArrayRecord({k: Array(np.ascontiguousarray(w)) for k, w in weights.items()})
        reply.content["metrics"] = MetricRecord(m)
        return reply

    @staticmethod
    def _common_metric_keys(replies: list[Message]) -> None:
        """Trim every reply's MetricRecord to the keys all replies share (Flower's FedAvg requires
        identical keys; an honest client adding a metric of its own must not abort the round)."""
        if not replies:
            return
        common = set.intersection(*(set(r.content["metrics"].keys()) for r in replies))
        for r in replies:
            m = r.content["metrics"]
            if set(m.keys()) != common:
                r.content["metrics"] = MetricRecord({k: v for k, v in m.items() if k in common})

    def _layers_mean(self, keys: list[str]) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for metric, name in (("layer-update-norm", "update-norm"), ("layer-compression-error", "compression-error")):
            rows = [s[metric] for s in self._layer_stats if isinstance(s.get(metric), list) and len(s[metric]) == len(keys)]
            if not rows:
                continue
            means = np.mean(np.nan_to_num(np.asarray(rows, dtype=np.float64), nan=0.0, posinf=0.0), axis=0)
            for k, v in zip(keys, means):
                out.setdefault(k, {})[name] = float(v)
        return out

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
            "density": statistics.fmean(s["density"] for s in stats) if stats else 0.0,
        }
        if stats:
            # Simulated wall-clock time of the round: the slowest client's compute + transfer time.
            out["round-seconds-simulated"] = max(client_seconds(s) for s in stats)
            out["train-seconds-max"] = max(s["train-seconds"] for s in stats)
            out["compress-seconds"] = statistics.fmean(s["compress-seconds"] for s in stats)
            out["decode-seconds"] = float(sum(s["decode-seconds"] for s in stats))
            out["residual-bytes"] = max(s["residual-bytes"] for s in stats)
        for name, nbytes in sorted(codec_bytes.items()):
            out[f"upload-bytes-{name}"] = float(nbytes)
        return out
