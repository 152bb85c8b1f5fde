"""``CompressedStrategy``: a Message-API strategy wrapper that decodes compressed replies."""

from __future__ import annotations

import fnmatch
import statistics
import time
from logging import ERROR, INFO, WARNING
from typing import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from ..compression import PayloadError, available_compressors
from .. import model_policy
from ..config import CodecConfig
from ..privacy import ClientLevelDP, LocalDP
from ..protocol import MODEL_KEY
from ..seeded_init import SeededInit
from ..device import reported_machine
from ..statedict import BF16, FlatModel, array_to_numpy, cast_checked, copy_array, numpy_to_array
from .admission import admit, check_max_num_examples
from .aggregate import ExactVotes, RunningSum, dense_memory_note, identity_on_one_reply, streams
from .decode import DecodedUpdate, decode_reply, is_dense_reply
from .downstream import Downstream
from .ef21 import EF21Aggregate
from .forward import ForwardsToInner
from .round_metrics import (  # noqa: F401
    _epsilon,
    _num,
    bounded_metrics,
    client_seconds,
    common_metric_keys,
    layers_mean,
    round_metrics,
)


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


def _as_weight(total: float) -> int | float:
    """A total weight as Flower's metrics take it (an int when it is one)."""
    return int(total) if float(total).is_integer() else float(total)


class CompressedStrategy(ForwardsToInner, Strategy):
    """Wrap any Message-API strategy so that clients send compressed updates.

    Like Flower's DP wrappers, it adds one concern and delegates the rest:

    1. ``configure_train``: adds the codec (``compressor``, ``density``, ``levels``,
       ``block-size``, ``value-dtype``, ``error-feedback``, ``residual-dtype``) to the train
       ConfigRecord and remembers the global weights sent in that round.
    2. ``aggregate_train``: decodes every reply produced by
       :func:`fedcomp.client.compression_mod` (validated: keys, shape, size, dtype,
       finiteness after the cast to the model's dtype) in node-id order and folds it into one
       running sum (:mod:`fedcomp.strategies.aggregate`; sparse payloads by scatter-add of
       their k entries) when ``inner`` aggregates by a weighted mean (FedAvg, FedProx,
       FedAvgM, FedAdam, FedYogi, FedAdagrad) or with ``client_dp``; ``inner`` then gets one
       pre-aggregated reply with the total weight, which gives it the same result. Other
       inner strategies get every reply as dense weights (the log says once what that
       costs). Integer/bool tensors are aggregated by :func:`fedcomp.statedict.integer_mean`
       / :func:`~fedcomp.statedict.bool_majority` whatever ``inner`` does, and every tensor
       comes back in its own dtype and shape. A reply that fails to decode is logged with
       its node id and reason and dropped before it touches the sum (``rejected-replies``);
       error replies are counted (``failed-clients``). The global model never sees either.
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
    error_feedback : bool or "ef21"
        Clients keep a residual (Karimireddy et al. 2019). Default True. "ef21": clients send
        ``C(update - h_i)`` and the server applies its estimate ``h`` (:mod:`.ef21`; Richtárik et
        al. 2021); needs a weighted-mean inner strategy, no ``client_dp``.
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
        Clients that missed rounds get the missed payloads or a compressed difference from the
        copy they hold, whichever is smaller (:mod:`fedcomp.strategies.downstream`).
    client_sampling : float, optional
        Poisson client sampling: the inner strategy should select every node (fraction 1.0);
        each is then kept independently with this probability q, per round. Needed for
        privacy amplification by sampling in client-level DP (``ClientLevelDP(sample_rate=q)``).
    seed : int, optional
        Seed of the Poisson sampling (tests only). Default None: OS entropy, as amplification by
        sampling needs a sample nobody can predict (the ServerApp never passes the run seed).
    aggregation : {"auto", "dense"}
        "auto" (default): for Flower's weighted-mean strategies (FedAvg, FedAvgM, FedAdam, FedYogi,
        FedAdagrad, FedProx) and client-level DP, fold every decoded reply into one running sum
        (server memory O(model) for any number of clients; sparse payloads in O(k)); every other
        inner strategy gets each client's dense weights. "dense": always the latter (for checks).
    downstream_init : SeededInit, optional
        The initial model as a seed and one bound per tensor (:func:`fedcomp.seeded_init.lora_init`):
        with ``downstream``, new clients build it themselves instead of downloading it dense.
    downstream_catchup : {"smallest", "exact"}
        What clients that missed rounds get: the smaller of the missed payloads and a per-client
        compressed diff (default), or the missed payloads whenever they exist ("exact": every client
        trains from a broadcast version; steadier with sparse downstream codecs such as STC).
    require_compression : bool
        Refuse dense replies (plain weights from a client without ``compression_mod``). Default
        False: a mixed fleet works, each dense reply is validated like a payload (the model's keys,
        shapes and dtypes; finite) and counted as an uncompressed update at its real bytes under
        ``upload-bytes-dense``. Dense replies are always refused under local DP and EF21.
    **params
        Codec parameters by their Python or run-config names: ``density``, ``levels``,
        ``block_size``, ``value_dtype``, ``residual_dtype``.

    Raises
    ------
    ValueError
        Unknown codec or a parameter out of range (at construction): among them ``max_epsilon``
        that is not a finite number > 0 and ``max_num_examples`` that is not an integer >= 1.
    AttributeError
        Setting a public attribute that neither this wrapper nor the inner strategy has (reads and
        writes of the inner strategy's settings are forwarded to it: :mod:`.forward`).

    Notes
    -----
    One node, one vote: in ``aggregate_train`` a second reply from a node, and a reply from a node
    that ``configure_train`` did not send a message to, are refused and counted in
    ``rejected-replies`` (:mod:`.admission`). Under ``local_dp`` the server keeps its own
    integer/bool tensors whatever a reply holds. Client-reported metrics are clamped to ±1e100.
    """

    def __init__(self, inner: Strategy, compressor: str = "stc", error_feedback: bool = True,
                 max_num_examples: int = 10**9, client_dp: ClientLevelDP | None = None,
                 local_dp: LocalDP | None = None, max_epsilon: float | None = None, downstream: str | None = None,
                 client_sampling: float | None = None, seed: int | None = None, aggregation: str = "auto",
                 downstream_init: SeededInit | None = None, require_compression: bool = False,
                 downstream_catchup: str = "smallest", **params) -> None:
        if aggregation not in ("auto", "dense"):
            raise ValueError(f"aggregation must be 'auto' or 'dense', got {aggregation!r}")
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
        self.max_num_examples = check_max_num_examples(max_num_examples)
        if not isinstance(require_compression, bool):
            raise ValueError(f"require_compression must be True or False, got {require_compression!r}")
        self.require_compression = require_compression
        if max_epsilon is not None and (isinstance(max_epsilon, bool) or not isinstance(max_epsilon, (int, float))
                                        or not max_epsilon > 0 or not np.isfinite(max_epsilon)):
            raise ValueError(f"max_epsilon (run config 'max-epsilon') must be a finite number > 0, or None for no "
                             f"budget; got {max_epsilon!r}")
        self.ef21 = EF21Aggregate() if self.codec.error_feedback == "ef21" else None
        if self.ef21 is not None and (client_dp is not None or aggregation != "auto" or not streams(inner)):
            raise ValueError("error_feedback='ef21' needs a weighted-mean inner strategy (FedAvg and its family), "
                             "aggregation='auto' and no client_dp: the server keeps EF21's estimate of the mean update")
        self._arr_key = "arrays"
        if downstream not in (None, "none") and downstream not in available_compressors():
            raise ValueError(f"downstream must be 'none' or one of {available_compressors()}, got {downstream!r}")
        self.downstream = (None if downstream in (None, "none")
                           else Downstream(self.codec, downstream, init=downstream_init,
                                           catchup=downstream_catchup))
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
        self._eps_floor_trace: list[float] = []
        self.aggregation = aggregation
        self._dense_noted = False
        self._local_rounds = 0
        self._sampled = 0
        self._sent: dict[int, dict[str, np.ndarray]] = {}
        #: Rounding remainder of the integer rule per integer tensor, carried from round to round
        #: (float64, entries in [-0.5, 0.5]; see :func:`fedcomp.statedict.integer_mean`).
        self.int_remainders: dict[str, np.ndarray] = {}
        #: Node ids sent a train message, per round (one node, one vote: others are refused).
        self._expected_nodes: dict[int, set[int]] = {}
        #: Per-round metrics computed by this wrapper (round -> dict).
        self.history: dict[int, dict[str, float]] = {}
        #: per round, the inner strategy's aggregate of the clients' evaluate replies (federated evaluation)
        self.evaluate_history: dict[int, dict[str, float]] = {}
        #: Per-round, per-layer means over clients: {name: {"update-norm", "compression-error"}}.
        self.layer_history: dict[int, dict[str, dict[str, float]]] = {}
        self._layer_stats: list[dict] = []
        self._round_codec = self.codec
        #: Per-round, per-client figures (round -> list of dicts with node, bytes, seconds, link speeds).
        self.client_history: dict[int, list[dict]] = {}
        self._start_forwarding()  # from here on, settings of the inner strategy reach it (issue 21, item 21)

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
            note = model_policy.describe(arrays.keys(), {k: int(np.prod(a.shape)) for k, a in arrays.items()}, self.codec)
            if note:  # per-model defaults, said once
                log(INFO, "%s", note)
            if MODEL_KEY in arrays:
                raise ValueError(f"the model has a tensor named '{MODEL_KEY}', the name fedcomp's whole-model payload "
                                 "travels under: rename that module or parameter")
        self.history.setdefault(server_round, {})
        self._sent = {server_round: FlatModel.from_record(arrays)}
        self._expected_nodes = {server_round: set()}
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
        self._expected_nodes = {server_round: {m.metadata.dst_node_id for m in msgs}}
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
        elif len(self._eps_floor_trace) >= 1:  # the lowest report: one client cannot stop everyone
            last = self._eps_floor_trace[-1]
            step = last - (self._eps_floor_trace[-2] if len(self._eps_floor_trace) >= 2 else 0.0)
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
        """Delegate unchanged; the result is also kept in ``evaluate_history[server_round]``."""
        replies = list(replies)
        metrics = self.inner.aggregate_evaluate(server_round, replies)
        if metrics is not None:
            ok = sum(1 for r in replies if not r.has_error())
            self.evaluate_history[server_round] = {**dict(metrics), "num-replies": float(ok)}
        return metrics

    # -- the one concern ---------------------------------------------------------------
    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode and validate every reply, fold it into the aggregate, hand the result to ``inner``.

        Orchestration only: decode -> validate (:func:`decode_reply`) -> fold (:mod:`.aggregate`:
        one running sum for weighted-mean strategies and client-level DP; every reply dense for
        the others) -> hand over -> restore dtypes and the integer/bool rule.
        """
        model = self._sent.get(server_round)
        if model is None:
            raise RuntimeError(f"aggregate_train for round {server_round} without configure_train")
        if isinstance(model, dict):  # tests and callers that set the sent weights by hand
            model = FlatModel(model, {k: str(np.asarray(v).dtype) for k, v in model.items()})
        # One node, one vote (duplicates and strangers refused), then a fixed order (by node id): float
        # sums, and so runs, do not depend on arrival order.
        replies, refused = admit(list(replies), lambda r: r.metadata.src_node_id, self._expected_nodes.get(server_round))
        for node, why in refused:
            log(WARNING, "round %s: rejected reply from node %s: %s", server_round, node, why)
        replies = sorted(replies, key=lambda r: r.metadata.src_node_id)
        streaming = self.client_dp is not None or (self.aggregation == "auto" and streams(self.inner))
        if not streaming and not self._dense_noted:
            log(INFO, "%s", dense_memory_note(self.inner, len(replies), model))
            self._dense_noted = True
        running = RunningSum(model)
        votes = ExactVotes(model, self.int_remainders)
        dense: list[Message] = []
        metric_contents: list[RecordDict] = []
        norms: list[float] = []
        stats: list[dict] = []
        self._layer_stats = []
        codec_bytes: dict[str, int] = {}
        rejected, failed = len(refused), 0
        wkey = self._inner_attr("weighted_by_key", "num-examples")
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
            try:  # everything is validated before anything is folded in
                update, metrics, stat, layers = self._decode_reply(reply, model, wkey)
            except (PayloadError, ValueError, TypeError, KeyError, OverflowError) as exc:
                rejected += 1
                log(WARNING, "round %s: rejected reply from node %s: %s", server_round, node, exc)
                continue
            weight = float(metrics[wkey])
            if self.client_dp is not None:  # clip each decoded update, sum unweighted
                norm = update.sq_norm() ** 0.5
                norms.append(norm)
                running.add(update, self.client_dp.clip_factor(norm), 1.0)
            elif streaming:
                running.add(update, weight)
                votes.add(update.exact, weight)
                self._carrier = reply
            else:
                votes.add(update.exact, weight)
                dense.append(self._dense_reply(reply, model, update, metrics))
            metric_contents.append(RecordDict({"metrics": MetricRecord(metrics)}))
            for name, nbytes in update.codecs.items():
                codec_bytes[name] = codec_bytes.get(name, 0) + nbytes
            if self.downstream is not None:
                self.downstream.received(node)
                stat["download-bytes"] = float(self.downstream.sent_bytes.get(node, 0))
            stats.append(stat)
            self._layer_stats.append(layers)
        budget = [r for r in replies if r.has_error() and "privacy budget" in (r.error.reason or "")]
        if replies and len(budget) == len(replies) and not self.stopped_reason:
            self.stopped_reason = (f"privacy budget: every client refused round {server_round} (max-epsilon reached); "
                                   "no further rounds are run")
            log(WARNING, "%s", self.stopped_reason)
        if self.ef21 is not None:  # EF21: the round's update is the server's estimate h (+= mean of the sends)
            self.ef21.fold(running)
        common_metric_keys(metric_contents)
        arrays, agg_metrics, dp_info = self._hand_over(server_round, model, running, votes, dense, metric_contents,
                                                       norms, wkey)
        ours = round_metrics(stats, codec_bytes, len(metric_contents), rejected, failed)
        ours.update(dp_info)
        self._account_epsilon(server_round, replies, stats, ours, dp_info)
        self.history[server_round] = ours
        self.client_history[server_round] = stats
        self.layer_history[server_round] = layers_mean(self._layer_stats, model.float_keys)
        merged = dict(agg_metrics) if agg_metrics is not None else {}
        merged.update(ours)
        return arrays, MetricRecord(merged)

    def _hand_over(self, server_round: int, model: FlatModel, running: RunningSum, votes: ExactVotes,
                   dense: list[Message], metric_contents: list[RecordDict], norms: list[float],
                   wkey: str) -> tuple[ArrayRecord | None, MetricRecord | None, dict]:
        """The aggregate in the model's dtypes: client-level DP's noisy mean, the inner strategy's
        result on one pre-aggregated reply (streaming) or on every dense reply; integer/bool
        tensors by fedcomp's rule. A result that is not finite in the model's dtypes is dropped."""
        if not metric_contents:
            return None, None, {}
        dp_info: dict[str, float] = {}
        if self.client_dp is not None:
            # Integer/bool tensors keep the global value: an exact aggregate would be released un-noised.
            agg, dp_info = self.client_dp.finish(running.flat(), norms, max(self._sampled, 1e-12))
            arrays, metrics = model.record(agg, check=False), None
        else:
            if running.count and identity_on_one_reply(self.inner):
                # FedAvg of one reply is that reply (weight factor w / w = 1.0 exactly): no copies to hand over.
                arrays = running.mean_record(votes.result(), portable=True)
                metrics = self._mean_metrics(metric_contents, wkey)
            else:
                if running.count:
                    # One pre-aggregated reply (a good reply's Message, its content replaced) with the total weight.
                    carrier = self._carrier
                    mean_metrics = self._mean_metrics(metric_contents, wkey)
                    carrier.content = RecordDict({
                        self._arr_key: running.mean_record(votes.result(), portable=True),
                        "metrics": MetricRecord({**dict(mean_metrics), wkey: _as_weight(running.total)})})
                    dense = [carrier]
                arrays, metrics = self.inner.aggregate_train(server_round, dense)
                if running.count and metrics is not None and wkey in mean_metrics:
                    metrics[wkey] = mean_metrics[wkey]  # what the inner strategy reports over every reply
                for reply in dense:  # drop the dense copies now (memory)
                    reply.content = RecordDict()
                del dense
        if arrays is None:
            return None, metrics, dp_info
        exact = votes.result()
        try:
            out = ArrayRecord()
            for k in model.keys:
                spec = model.specs[k]
                if spec.is_float:
                    a = arrays[k]
                    w = array_to_numpy(a)
                    if spec.dtype != BF16 and w.dtype == np.dtype(spec.dtype) and w.shape == spec.shape:
                        if w.size and not np.isfinite(w).all():  # already in the model's dtype: check, keep
                            raise ValueError(f"'{k}': aggregate is not finite in the model's dtype {spec.dtype}")
                        out[k] = a
                        continue
                    w = np.asarray(w, dtype=np.float64 if spec.dtype == "float64" else np.float32).reshape(spec.shape)
                    out[k] = numpy_to_array(cast_checked(k, w, spec.dtype), spec.dtype)
                else:
                    out[k] = Array(copy_array(model.exact[k] if self.client_dp is not None else exact[k]))
        except ValueError as exc:
            log(ERROR, "round %s: the aggregated model is not finite (%s); keeping the previous global model",
                server_round, exc)
            return None, metrics, dp_info
        return out, metrics, dp_info

    def _mean_metrics(self, metric_contents: list[RecordDict], wkey: str) -> MetricRecord:
        """What the inner strategy's metric aggregation gives over every reply (its
        ``train_metrics_aggr_fn``, Flower's weighted mean by default)."""
        fn = self._inner_attr("train_metrics_aggr_fn", None)
        return MetricRecord(dict(fn(metric_contents, wkey))) if callable(fn) else MetricRecord({})

    def _dense_reply(self, reply: Message, model: FlatModel, update, metrics: dict) -> Message:
        """An ordinary reply (dense weights of every tensor in its dtype) for inner strategies that
        need every client's weights."""
        for key in list(reply.content.keys()):
            del reply.content[key]
        reply.content[self._arr_key] = model.record(update.to_flat(model.num_float, model.flat.dtype), update.exact,
                                                    check=False,
                                                    portable=True)
        reply.content["metrics"] = MetricRecord(metrics)
        return reply

    def _account_epsilon(self, server_round: int, replies: list, stats: list[dict], ours: dict, dp_info: dict) -> None:
        """Epsilon bookkeeping of the round: reported (DP-SGD) or computed (client-level, local)."""
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
            self._eps_floor_trace.append(min(reported))
        nexts = {s["node"]: s["epsilon-next"] for s in stats if s["epsilon-next"] is not None}
        if nexts:
            # Unverifiable reports: the federation stops only when even the lowest projection exceeds the
            # budget. A client whose own projection exceeds it refuses the next round itself (logged here).
            self._eps_next = min(nexts.values())
            if self.max_epsilon is not None:
                for node, e in sorted(nexts.items()):
                    if e > self.max_epsilon:
                        log(WARNING, "round %s: node %s reports a projected epsilon of %.3g > max-epsilon %s; it "
                            "will refuse further rounds, the others go on", server_round, node, e, self.max_epsilon)

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

    def _decode_reply(self, reply: Message, model: FlatModel, wkey: str) -> tuple[DecodedUpdate, dict, dict, dict]:
        """Decode one reply and read its metrics; raises before anything is folded.

        Returns ``(update, metrics kept for the inner strategy, per-client stats, per-layer stats)``.
        """
        recs = reply.content.array_records
        if len(recs) != 1:
            raise PayloadError(f"expected one ArrayRecord in the reply, found {len(recs)}")
        mrecs = reply.content.metric_records
        if len(mrecs) != 1:
            raise PayloadError(f"expected one MetricRecord in the reply, found {len(mrecs)}")
        m = dict(next(iter(mrecs.values())))
        n = m.get(wkey)
        if (isinstance(n, bool) or not isinstance(n, (int, float)) or not np.isfinite(n) or n < 1
                or n != int(n) or n > self.max_num_examples):
            raise PayloadError(f"'{wkey}' must be an integer in [1, {self.max_num_examples}], got {n!r}")
        t0 = time.perf_counter()
        record = next(iter(recs.values()))
        if is_dense_reply(record):  # a client without compression_mod (mixed fleet, issue 21 item 20)
            why = ("require_compression is set" if self.require_compression else
                   "local DP needs every client to clip and noise its update" if self.local_dp is not None else
                   "EF21's server estimate mirrors the clients' compressed sends" if self.ef21 is not None else "")
            if why:
                raise PayloadError(f"a dense reply (no fedcomp payload) is refused: {why}; add compression_mod as the "
                                   "FIRST mod of the ClientApp (mods=[compression_mod, ...])")
        update = decode_reply(record, model)
        if self.local_dp is not None:  # local DP: the server keeps its own integer/bool values, whatever a client sent
            update.exact = {}
        decode_s = time.perf_counter() - t0
        layers = {k: m.pop(k) for k in ("layer-update-norm", "layer-compression-error") if k in m}
        eps, eps_next = (_epsilon(m.get(k)) for k in ("epsilon", "epsilon-next"))
        # Keep only finite scalar metrics, bounded: the inner strategy averages them, metrics.json stores them.
        m = bounded_metrics(m)
        stat = {
            "node": reply.metadata.src_node_id,
            "decode-seconds": decode_s,
            "train-seconds": _num(m, "train-seconds"),
            "compress-seconds": _num(m, "compress-seconds"),
            "uplink-mbps": _num(m, "uplink-mbps", 1.0) if _num(m, "uplink-mbps", 1.0) > 0 else 1.0,
            "downlink-mbps": _num(m, "downlink-mbps", 10.0) if _num(m, "downlink-mbps", 10.0) > 0 else 10.0,
            "residual-bytes": _num(m, "residual-bytes"),
            "residual-saturated": _num(m, "residual-saturated"),
            "upload-bytes": float(update.upload_bytes),
            "dense-bytes": float(model.dense_bytes),
            "compression-error": _num(m, "compression-error"),
            "residual-norm": _num(m, "residual-norm"),
            "download-bytes": _num(m, "download-bytes"),
            "density": _num(m, "density"),
            "client-peak-rss-mb": _num(m, "client-peak-rss-mb"),
            "machine": reported_machine(reply.content),
            "epsilon": eps,
            "epsilon-next": eps_next,
        }
        return update, m, stat, layers

