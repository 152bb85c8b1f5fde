"""``CompressedStrategy``: a Message-API strategy wrapper that decodes compressed replies."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from logging import ERROR, INFO, WARNING
from typing import Any, Iterable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from ..compression import PayloadError, available_compressors
from .. import model_policy
from ..config import CodecConfig
from ..device import reported_machine
from ..privacy import ClientLevelDP, LocalDP
from ..protocol import MODEL_KEY
from ..seeded_init import SeededInit
from ..statedict import FlatModel
from .admission import admit, check_max_num_examples
from .aggregate import (
    ClippedFold,
    DenseFold,
    MeanFold,
    dense_memory_note,
    identity_on_one_reply,
    in_model_dtypes,
    streams,
)
from .decode import decode_train_reply
from .downstream import Downstream
from .ef21 import EF21Aggregate
from .failures import failed_client, missing_clients, oom_confirmations
from .forward import ForwardsToInner
from .privacy import PoissonSampling, PrivacyBudget
from .round_metrics import client_stats, common_metric_keys, layers_mean, round_metrics
from .wrapping import find_attr, load_optimizer_state, optimizer_state, wraps


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


@dataclass
class SentRound:
    """What the server sent in one round: the global model and how many clients were sampled
    (the divisor of client-level DP: the count, or ``q * N`` under Poisson sampling)."""

    server_round: int
    model: FlatModel
    sampled: float = 0.0
    #: Node ids sent a train message (one node, one vote: replies from others are refused); None: unknown.
    nodes: set[int] | None = None
    #: The train messages as sent (Flower sets their message ids when it pushes them): error replies
    #: name the message they answer, and through it the failed node (:mod:`.failures`).
    messages: list[Message] = field(default_factory=list)


@dataclass
class RoundReplies:
    """The accepted replies of a round, folded, with what the round's metrics need."""

    fold: Any
    carrier: Message | None = None  # an accepted reply whose Message carries a pre-aggregated one
    metric_contents: list[RecordDict] = field(default_factory=list)
    stats: list[dict] = field(default_factory=list)
    layer_stats: list[dict] = field(default_factory=list)
    codec_bytes: dict[str, int] = field(default_factory=dict)
    rejected: int = 0
    failed: int = 0
    failures: list[dict] = field(default_factory=list)  # one per failed client (:func:`.failures.failed_client`)


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
       ``round-seconds-simulated``: the slowest client's compute time (in a deployment its
       ClientApp process's life) + upload bytes·8 / uplink + download bytes·8 / downlink, at
       the link speeds each client declared (node config ``uplink-mbps``/``downlink-mbps``),
       + Flower's polling in a deployment (:func:`.round_metrics.client_seconds`). Client-reported numbers are
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
    downstream_max_copies : float
        With ``downstream``: most model copies the server keeps for nodes (older versions, per-node
        catch-up copies, payloads); least recently replying nodes are forgotten first and then treated
        as new. Default 8 (:class:`.downstream.Downstream`).
    require_compression : bool
        Refuse dense replies (plain weights from a client without ``compression_mod``). Default
        False: a mixed fleet works, each dense reply is validated like a payload (the model's keys,
        shapes and dtypes; finite) and counted as an uncompressed update at its real bytes under
        ``upload-bytes-dense``. Dense replies are always refused under local DP, EF21 and
        ``downstream`` (the node was sent a compressed copy, not the global weights).
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
                 downstream_catchup: str = "smallest", downstream_max_copies: float = 8, **params) -> None:
        if aggregation not in ("auto", "dense"):
            raise ValueError(f"aggregation must be 'auto' or 'dense', got {aggregation!r}")
        if not isinstance(inner, Strategy):
            raise TypeError(f"inner must be a flwr.serverapp.strategy.Strategy, got {type(inner).__name__}")
        self.inner = inner
        self.codec = CodecConfig.from_kwargs(compressor, error_feedback, **params)
        if self.codec.error_feedback and wraps(inner, "DifferentialPrivacyClientSide"):
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
        if self.ef21 is not None and float(getattr(inner, "fraction_train", 1.0)) < 1.0:
            raise ValueError("error_feedback='ef21' needs every client in every round (fraction_train = 1.0, run config "
                             "'fraction-train'): the server's single estimate h keeps a departed client's last h_i")
        self.aggregation = aggregation
        if downstream not in (None, "none") and downstream not in available_compressors():
            raise ValueError(f"downstream must be 'none' or one of {available_compressors()}, got {downstream!r}")
        self.downstream = (None if downstream in (None, "none")
                           else Downstream(self.codec, downstream, init=downstream_init,
                                           catchup=downstream_catchup, max_copies=downstream_max_copies))
        self.sampling = None if client_sampling is None else PoissonSampling(client_sampling, seed)
        self.budget = PrivacyBudget(client_dp, local_dp, max_epsilon)
        #: The global model sent in the current round (set by :meth:`configure_train`).
        self.sent_round: SentRound | None = None
        #: Rounding remainder of the integer rule per integer tensor, carried from round to round
        #: (float64, entries in [-0.5, 0.5]; see :func:`fedcomp.statedict.integer_mean`).
        self.int_remainders: dict[str, np.ndarray] = {}
        self._dense_noted = False  # the dense path's memory cost is logged once per run
        #: Per-round metrics computed by this wrapper (round -> dict).
        self.history: dict[int, dict[str, float]] = {}
        #: per round, the inner strategy's aggregate of the clients' evaluate replies (federated evaluation)
        self.evaluate_history: dict[int, dict[str, float]] = {}
        #: Per-round, per-layer means over clients: {name: {"update-norm", "compression-error"}}.
        self.layer_history: dict[int, dict[str, dict[str, float]]] = {}
        #: Per-round, per-client figures (round -> list of dicts with node, bytes, seconds, link speeds).
        self.client_history: dict[int, list[dict]] = {}
        #: Per-round failed clients (round -> list of {node, code, error, reason}, :mod:`.failures`).
        self.failure_history: dict[int, list[dict]] = {}
        self._oom_seen: dict[int, int] = {}  # node -> the last client-oom-kills count it reported
        self._start_forwarding()  # from here on, settings of the inner strategy reach it (:mod:`.forward`)

    @classmethod
    def from_codec_config(cls, inner: Strategy, codec: CodecConfig, **options) -> "CompressedStrategy":
        """Build from a parsed :class:`fedcomp.config.CodecConfig` (e.g. from the run config);
        ``options`` are the other constructor arguments (``client_dp``, ``max_epsilon``, ...)."""
        params = {k.replace("-", "_"): v for k, v in codec.to_mapping().items()}
        return cls(inner, **params, **options)

    # -- the privacy settings, kept by the budget ----------------------------------------
    @property
    def client_dp(self) -> ClientLevelDP | None:
        """Client-level DP-FedAvg (None: the inner strategy aggregates)."""
        return self.budget.client_dp

    @property
    def local_dp(self) -> LocalDP | None:
        """Local DP settings sent to clients (None: none)."""
        return self.budget.local_dp

    @property
    def max_epsilon(self) -> float | None:
        """The privacy budget (None: none)."""
        return self.budget.max_epsilon

    @property
    def stopped_reason(self) -> str:
        """Why no further rounds are run ("" while rounds go on)."""
        return self.budget.stopped_reason

    @property
    def poisson_rate(self) -> float | None:
        """Poisson client-sampling rate q (None: the inner strategy's sample is kept)."""
        return None if self.sampling is None else self.sampling.rate

    # -- state for checkpoints -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs: ``{"privacy": JSON-serialisable accounting,
        "optimizer": {name: np.ndarray} of the inner strategy's server optimizer,
        "int-remainders": {tensor: float64 np.ndarray} of the integer rule,
        "ef21": {tensor: flat float64 np.ndarray} EF21's server estimate h (empty without EF21)}``."""
        return {"privacy": self.budget.state_dict(), "optimizer": optimizer_state(self.inner),
                "int-remainders": {k: np.array(v, copy=True) for k, v in self.int_remainders.items()},
                "ef21": self.ef21.state_dict() if self.ef21 is not None else {}}

    def load_state_dict(self, state: dict[str, Any], shapes: dict[str, tuple]) -> None:
        """Restore :meth:`state_dict`; ``shapes``: the model's tensor shapes (model order).

        Raises
        ------
        ValueError
            Optimizer state the inner strategy does not have or that does not fit ``shapes``; an
            EF21 estimate without EF21, or one that does not fit ``shapes``.
        """
        load_optimizer_state(self.inner, state.get("optimizer", {}), shapes)
        ef21 = state.get("ef21", {})
        if ef21 and self.ef21 is None:
            raise ValueError("the checkpoint holds EF21's server estimate h but error-feedback is not 'ef21'")
        if self.ef21 is not None:
            self.ef21.load_state_dict(ef21, shapes)
        self.budget.load_state_dict(state.get("privacy", {}))
        self.int_remainders = dict(state.get("int-remainders", {}))

    # -- delegation -------------------------------------------------------------------
    def summary(self) -> None:
        """Log the codec, then the inner strategy's summary."""
        log(INFO, "\t├──> CompressedStrategy: %s", self.codec.describe())
        self.inner.summary()

    def remember(self, server_round: int, model: FlatModel, sampled: float = 0.0, nodes: set[int] | None = None) -> None:
        """Record the global model sent in ``server_round`` (what :meth:`configure_train` does;
        public for callers that build the round's replies themselves; ``nodes`` None: any node's
        first reply counts)."""
        self.sent_round = SentRound(server_round, model, sampled, nodes)

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
        self.remember(server_round, FlatModel.from_record(arrays), nodes=set())
        if self.budget.exhausted(server_round):
            return []
        for k, v in codec.to_mapping().items():
            config[k] = v
        self.budget.train_config(config)
        msgs = list(self.inner.configure_train(server_round, arrays, config, grid))
        self.sent_round.sampled = len(msgs)
        if self.sampling is not None:
            msgs, self.sent_round.sampled = self.sampling.sample(msgs)
        self.sent_round.nodes = {m.metadata.dst_node_id for m in msgs}
        self.sent_round.messages = msgs
        if self.downstream is not None and msgs:
            self.downstream.prepare(server_round, arrays, msgs)
        return msgs

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

        Orchestration only: decode -> validate (:func:`.decode.decode_train_reply`) -> fold (a
        policy of :mod:`.aggregate`) -> hand over -> restore dtypes and the integer/bool rule ->
        metrics and the privacy accounting of the round.
        """
        sent = self.sent_round
        if sent is None or sent.server_round != server_round:
            raise RuntimeError(f"aggregate_train for round {server_round} without configure_train")
        model = sent.model
        # One node, one vote (duplicates and strangers refused, :mod:`.admission`), then a fixed order
        # (by node id): float sums, and so runs, do not depend on arrival order.
        # Error replies carry no update (no vote) and count as failed clients with their reason: Flower answers
        # a task it lost (e.g. a ClientApp the OOM killer took) from the SuperLink's node id, which the stranger
        # check would misreport as a reply "not sent a message this round".
        replies = list(replies)
        errors = [r for r in replies if r.has_error()]
        replies, refused = admit([r for r in replies if not r.has_error()], lambda r: r.metadata.src_node_id,
                                 sent.nodes)
        for node, why in refused:
            log(WARNING, "round %s: rejected reply from node %s: %s", server_round, node, why)
        replies = errors + sorted(replies, key=lambda r: r.metadata.src_node_id)
        got = self._fold(server_round, replies, model)
        self._note_failures(server_round, sent, replies, refused, got)
        got.rejected += len(refused)
        ef21_missing = None
        if self.ef21 is not None:  # EF21: the round's update is the server's estimate h (+= mean of the sends)
            self.ef21.fold(got.fold.running)
            asked = len(sent.nodes) if sent.nodes is not None else len(replies) + len(refused)
            ef21_missing = max(asked - len(got.stats), 0)
            if ef21_missing:
                log(WARNING, "round %s: EF21: %s sampled client(s) sent no accepted update; their last h_i stays in "
                    "the server's estimate h (drift until they return)", server_round, ef21_missing)
        self.budget.note_refusals(server_round, replies)
        common_metric_keys(got.metric_contents)
        arrays, agg_metrics, dp_info = self._hand_over(server_round, model, got, sent.sampled)
        ours = round_metrics(got.stats, got.codec_bytes, len(got.metric_contents), got.rejected, got.failed)
        ours.update(dp_info)
        if ef21_missing is not None:
            ours["ef21-missing-clients"] = float(ef21_missing)
        self.budget.account(server_round, bool(replies), got.stats, ours)
        self.history[server_round] = ours
        self.client_history[server_round] = got.stats
        self.layer_history[server_round] = layers_mean(got.layer_stats, model.float_keys)
        merged = dict(agg_metrics) if agg_metrics is not None else {}
        merged.update(ours)
        return arrays, MetricRecord(merged)

    def _note_failures(self, server_round: int, sent: SentRound, replies: list[Message], refused: list,
                       got: RoundReplies) -> None:
        """Sampled nodes that sent nothing count as failed too (no silent dropouts); a node whose
        container's OOM-kill count went up is named (:func:`.failures.oom_confirmations`)."""
        answered = {f["node"] for f in got.failures} | {r.metadata.src_node_id for r in replies if not r.has_error()}
        answered |= {node for node, _ in refused}
        # an error reply we could not trace to its node (answered from the SuperLink's id for a message
        # we did not see sent) stands for one of the silent nodes: then which one is unknown
        unknown = sent.nodes is not None and any(f["node"] not in sent.nodes for f in got.failures)
        for f in [] if unknown else missing_clients(sent.nodes, answered):
            got.failed += 1
            got.failures.append(f)
            log(WARNING, "round %s: client (node %s) failed: %s", server_round, f["node"], f["reason"])
        for c in oom_confirmations(self._oom_seen, got.stats):
            log(WARNING, "round %s: node %s: the kernel's out-of-memory killer killed %s process(es) in its "
                "container since the server last heard from it (oom_kill count %s -> %s): its ClientApp ran out "
                "of memory", server_round, c["node"], c["oom-kills"] - c["oom-kills-before"], c["oom-kills-before"],
                c["oom-kills"])
        self.failure_history[server_round] = got.failures

    def _new_fold(self, model: FlatModel, clients: int):
        """The folding policy of the round: clipped (client-level DP), weighted mean, or dense."""
        if self.client_dp is not None:
            return ClippedFold(model, self.client_dp)
        if self.aggregation == "auto" and streams(self.inner):
            return MeanFold(model, self.int_remainders)
        if not self._dense_noted:
            log(INFO, "%s", dense_memory_note(self.inner, clients, model))
            self._dense_noted = True
        return DenseFold(model, self._record_key(), self.int_remainders)

    def _fold(self, server_round: int, replies: list[Message], model: FlatModel) -> RoundReplies:
        """Decode every reply and fold the good ones in; failed and rejected ones are logged and counted."""
        got = RoundReplies(self._new_fold(model, len(replies)))
        wkey = self._weight_key()
        refuse_dense = ("require_compression is set" if self.require_compression else
                        "local DP needs every client to clip and noise its update" if self.local_dp is not None else
                        "EF21's server estimate mirrors the clients' compressed sends" if self.ef21 is not None else
                        "downstream compression: the server cannot tell which model a dense reply is relative to "
                        "(the node was sent a compressed copy)" if self.downstream is not None else "")
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error():
                got.failed += 1
                got.failures.append(failed_client(reply, {m.metadata.message_id: m.metadata.dst_node_id
                                                          for m in self.sent_round.messages}))
                log(WARNING, "round %s: client (node %s) failed: %s", server_round, got.failures[-1]["node"],
                    _failure_reason(reply) if reply.error.code not in (4, 5, 8) else got.failures[-1]["reason"])
                continue
            try:  # everything is validated before anything is folded in
                # local DP: the server keeps its own integer/bool values, whatever a client sent
                decoded = decode_train_reply(reply, model, wkey, self.max_num_examples, refuse_dense,
                                             keep_exact=self.local_dp is None)
            except (PayloadError, ValueError, TypeError, KeyError, OverflowError) as exc:
                got.rejected += 1
                log(WARNING, "round %s: rejected reply from node %s: %s", server_round, node, exc)
                continue
            got.fold.add(reply, decoded)
            got.carrier = reply
            got.metric_contents.append(RecordDict({"metrics": MetricRecord(decoded.metrics)}))
            for name, nbytes in decoded.update.codecs.items():
                got.codec_bytes[name] = got.codec_bytes.get(name, 0) + nbytes
            stat = client_stats(node, decoded.reported, decoded.update.upload_bytes, model.dense_bytes,
                                decoded.decode_seconds, reported_machine(reply.content))
            if self.downstream is not None:
                self.downstream.received(node)
                stat["download-bytes"] = float(self.downstream.sent_bytes.get(node, 0))
            got.stats.append(stat)
            got.layer_stats.append(decoded.layers)
        return got

    def _hand_over(self, server_round: int, model: FlatModel, got: RoundReplies,
                   sampled: float) -> tuple[ArrayRecord | None, MetricRecord | None, dict]:
        """The aggregate in the model's dtypes: client-level DP's noisy mean, the inner strategy's
        result on one pre-aggregated reply (weighted mean) or on every dense reply; integer/bool
        tensors by fedcomp's rule. A result that is not finite in the model's dtypes is dropped."""
        if not got.metric_contents:
            return None, None, {}
        fold, dp_info, metrics = got.fold, {}, None
        if isinstance(fold, ClippedFold):
            agg, dp_info = fold.finish(sampled)
            arrays, exact = model.record(agg, check=False), model.exact
        elif isinstance(fold, MeanFold) and identity_on_one_reply(self.inner):
            # FedAvg of one reply is that reply (weight factor w / w = 1.0 exactly): no copies to hand over.
            exact = fold.votes.result()
            arrays = fold.running.mean_record(exact, portable=True)
            metrics = self._mean_metrics(got.metric_contents)
        else:
            exact = fold.votes.result()
            arrays, metrics = self._inner_aggregate(server_round, fold, exact, got)
        if arrays is None:
            return None, metrics, dp_info
        try:
            return in_model_dtypes(arrays, model, exact), metrics, dp_info
        except ValueError as exc:
            log(ERROR, "round %s: the aggregated model is not finite (%s); keeping the previous global model",
                server_round, exc)
            return None, metrics, dp_info

    def _inner_aggregate(self, server_round: int, fold, exact: dict[str, np.ndarray],
                         got: RoundReplies) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The inner strategy's aggregate of every dense reply, or of one pre-aggregated reply (an
        accepted reply's Message, its content replaced) carrying the total weight."""
        wkey = self._weight_key()
        if isinstance(fold, DenseFold):
            replies = fold.replies
        else:
            mean_metrics = self._mean_metrics(got.metric_contents)
            got.carrier.content = RecordDict({
                self._record_key(): fold.running.mean_record(exact, portable=True),
                "metrics": MetricRecord({**dict(mean_metrics), wkey: _as_weight(fold.running.total)})})
            replies = [got.carrier]
        arrays, metrics = self.inner.aggregate_train(server_round, replies)
        if isinstance(fold, MeanFold) and metrics is not None and wkey in mean_metrics:
            metrics[wkey] = mean_metrics[wkey]  # what the inner strategy reports over every reply
        for reply in replies:  # drop the dense copies now (memory)
            reply.content = RecordDict()
        return arrays, metrics

    def _mean_metrics(self, metric_contents: list[RecordDict]) -> MetricRecord:
        """What the inner strategy's metric aggregation gives over every reply (its
        ``train_metrics_aggr_fn``, Flower's weighted mean by default)."""
        fn = find_attr(self.inner, "train_metrics_aggr_fn", None)
        return MetricRecord(dict(fn(metric_contents, self._weight_key()))) if callable(fn) else MetricRecord({})

    def _weight_key(self) -> str:
        """The metric the inner strategy weights replies by (Flower's ``weighted_by_key``)."""
        return find_attr(self.inner, "weighted_by_key", "num-examples")

    def _record_key(self) -> str:
        """Where the inner strategy reads weights in a reply (Flower's ``arrayrecord_key``)."""
        return find_attr(self.inner, "arrayrecord_key", "arrays")


def _failure_reason(reply: Message) -> str:
    """A failed client's error reason, with a hint when it looks like a mis-assembled app."""
    reason = reply.error.reason or ""
    if "fedcomp.payload" in reason or "clipping_mod expects the keys" in reason:
        reason += (" (hint: compression_mod must be the first mod of the ClientApp, Flower's DP mods go "
                   "in @app.train(mods=[...]), and the server strategy must be wrapped in CompressedStrategy)")
    return reason
