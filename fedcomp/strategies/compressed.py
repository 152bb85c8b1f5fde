"""``CompressedStrategy``: a Message-API strategy wrapper that decodes compressed replies."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedcomp.config import CodecConfig
from fedcomp.config.codec import BATCHNORM_STATS_CODEC
from fedcomp.privacy import ClientLevelDP, LocalDP
from fedcomp.download.layout import VAR_FLOOR
from fedcomp.download.seeded_init import SeededInit
from fedcomp.statedict import FlatModel
from fedcomp.statedict.tied import find_tied
from fedcomp.strategies.admission import admit, check_max_num_examples
from fedcomp.strategies.aggregate import streams
from fedcomp.strategies.codec_round import add_codec, check_feedback_under_dp, check_model
from fedcomp.download.correction import check_correction, correction_refusal
from fedcomp.download.round_hook import DownloadHook
from fedcomp.download.sender import Downstream, check_max_copies
from fedcomp.strategies.ef21_aggregate import EF21Aggregate
from fedcomp.strategies.fold_policy import FoldPolicy, dense_refusal
from fedcomp.strategies.forward import ForwardsToInner
from fedcomp.strategies.handover import hand_over, weight_key
from fedcomp.strategies.presets import apply_preset, library_codec_params, library_downstream
from fedcomp.strategies.privacy_budget import PoissonSampling, PrivacyBudget
from fedcomp.strategies.replies import RoundReplies, evaluate_replies, fold_replies, note_failures
from fedcomp.strategies.round_history import RoundHistory, SentRound
from fedcomp.strategies.round_metrics import HEADLINE_KEYS, common_metric_keys, headline, layers_mean, round_metrics
from fedcomp.strategies.wire_bytes import WireCount
from fedcomp.strategies.wrapping import load_optimizer_state, optimizer_state


def _history(name: str) -> property:
    """A read-only view of one of `RoundHistory`'s dicts under its public name."""
    return property(lambda self: getattr(self.rounds, name), doc=f"``RoundHistory.{name}`` (round -> figures).")


def _budget(name: str, doc: str) -> property:
    """A read-only view of one of `PrivacyBudget`'s settings."""
    return property(lambda self: getattr(self.budget, name), doc=doc)


class CompressedStrategy(ForwardsToInner, Strategy):
    """Wrap any Message-API strategy so that clients send compressed updates.

    Like Flower's DP wrappers, it adds one concern (the codec) and delegates the rest. The other
    concerns it carries are objects of their own, called in named steps: the privacy budget and
    Poisson sampling (`privacy_budget`), the downstream sender (`fedcomp.download.sender`),
    EF21's server estimate (`ef21_aggregate`) and the per-round figures
    (`round_history`). A round:

    1. ``configure_train``: adds the codec (``compressor``, ``density``, ``levels``,
       ``block-size``, ``value-dtype``, ``error-feedback``, ``residual-dtype``) to the train
       ConfigRecord and remembers the global weights sent in that round.
    2. ``aggregate_train``: decodes every reply produced by
       [`fedcomp.client.compression_mod`][] (validated: keys, shape, size, dtype,
       finiteness after the cast to the model's dtype) in node-id order and folds it into one
       running sum (`fedcomp.strategies.aggregate`; sparse payloads by scatter-add of
       their k entries) when ``inner`` aggregates by a weighted mean (FedAvg, FedProx,
       FedAvgM, FedAdam, FedYogi, FedAdagrad) or with ``client_dp``; ``inner`` then gets one
       pre-aggregated reply with the total weight, which gives it the same result. Other
       inner strategies get every reply as dense weights (the log says once what that
       costs). Integer/bool tensors are aggregated by `fedcomp.statedict.integer_mean`
       / `bool_majority` whatever ``inner`` does, and every tensor
       comes back in its own dtype and shape. A reply that fails to decode is logged with
       its node id and reason and dropped before it touches the sum (``rejected-replies``);
       error replies are counted (``failed-clients``). The global model never sees either.
    3. Keeps the round's metrics in ``history[server_round]``
       (`round_metrics.round_metrics`): ``upload-bytes`` (payload bytes received),
       ``dense-bytes``, ``compression-ratio`` (dense / upload), ``compression-error`` and
       ``residual-norm`` (means over clients), ``download-bytes``, ``num-replies``,
       ``rejected-replies``, ``failed-clients``, ``upload-bytes-<codec>`` per codec, and
       ``round-seconds-simulated`` at the link speeds each client declared
       (`round_metrics.client_seconds`); per client in ``client_history``. Client-reported
       numbers are untrusted: non-numbers and non-finite values count as 0. The MetricRecord
       returned to Flower (its per-round log line and ``Result``) holds the inner strategy's
       average of the app's own client metrics (``compression_mod``'s report,
       `fedcomp.protocol.messages.REPORT_KEYS`, is left out of it) and the headline figures
       `round_metrics.HEADLINE_KEYS`, which are the wrapper's own: a client metric under one of
       those names (e.g. DP-SGD clients' ``epsilon``) is not averaged into Flower's record.

    Parameters
    ----------
    inner : Strategy
        Any Message-API strategy: FedAvg, FedAdam, FedProx, Flower's DP wrappers, ...
        It only ever receives dense, validated replies.
    compressor : str
        Codec name (see `fedcomp.compression.available_compressors`). Default (None) "stc".
    error_feedback : bool or "ef21"
        Clients keep a residual (Karimireddy et al. 2019). Default True. "ef21": clients send
        ``C(update - h_i)`` and the server applies its estimate ``h`` (`ef21`; Richtárik et
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
        The server-to-client codec ("fp16", "stc", ...; None or "none": dense). ``"auto"``
        (default): int8 with server-side error feedback for any compressed upload, dense for
        ``compressor = "none"``, under ``local_dp`` and for inner strategies that need every
        client's weights (`presets.library_downstream`). Clients that hold
        the previous broadcast get ``C(global - broadcast)`` (server-side error feedback); a client
        that holds nothing gets the first contact ``downstream_init`` says; clients that missed
        rounds get the missed payloads or a compressed difference from the copy they hold,
        whichever is smaller (`fedcomp.download.sender`). Evaluate messages
        travel the same way. Needs ``compression_mod`` on every client (it rebuilds and keeps the
        model copy); a client without it cannot read the download: pass ``"none"`` for a fleet
        that mixes plain clients in.
    client_sampling : float, optional
        Poisson client sampling: the inner strategy should select every node (fraction 1.0);
        each is then kept independently with this probability q, per round. Needed for
        privacy amplification by sampling in client-level DP (``ClientLevelDP(sample_rate=q)``).
    seed : int, optional
        Seed of the Poisson sampling (tests only). Default None: OS entropy, as amplification by
        sampling needs a sample nobody can predict (the ServerApp never passes the run seed).
    aggregation : {"auto", "dense"}
        "auto" (default): fold into one running sum where step 2 says (server memory O(model) for
        any number of clients; sparse payloads in O(k)), else each client's dense weights.
        "dense": always the latter (for checks).
    downstream_init : SeededInit or str
        With ``downstream``: what a client that holds nothing gets first. ``"auto"`` (default): a
        seeded start for LoRA adapters at peft's initialisation (the strategy draws ``lora_A`` from a
        seed; clients build the adapters from it), else the initial model compressed with ``int8``
        (one start payload for every client; error feedback carries the rest). ``"seeded"``: every
        float tensor drawn from a seed with its mean and variance (models trained from scratch only:
        `fedcomp.download.seeded_init.seeded_like`). A codec name: a compressed start with it.
        ``"dense"``: the model dense. A `SeededInit` (`fedcomp.download.seeded_init.lora_init`):
        the initial model is that seed's, and clients build it themselves.
    downstream_density : float, optional
        Density of a sparse downstream codec (default: ``density``, the upload's).
    downstream_catchup : {"smallest", "exact"}
        What clients that missed rounds get: the smaller of the missed payloads and a per-client
        compressed diff (default), or the missed payloads whenever they exist ("exact": every client
        trains from a broadcast version; steadier with sparse downstream codecs such as STC).
    downstream_max_copies : float or None
        With ``downstream``: most model copies the server keeps for nodes (older versions, per-node
        catch-up copies, payloads); past it statistics copies are dropped, then nodes forgotten (and
        treated as new) in the order that forgets fewest (`node_copies.NodeCopies.evict`).
        Default None: 8, or as many as 256 MiB holds when that is more (a small model keeps every
        node's copy; `node_copies.NodeCopies.copy_budget`).
    downstream_correction : float
        With ``downstream``: fold each client's update as ``delta_i - c (G - H_i)``, where ``H_i`` is
        the copy of the global model ``G`` it trained from (local training re-learns much of what the
        compressed download left out; counted again on top of ``G``, it overshoots:
        `fedcomp.download.correction`). ``c`` in [0, 1], default 0; 1 measured best with AdamW on the
        clients and STC downward (fedcomp's app sets it so). Weighted-mean rounds only: ``c > 0``
        without ``downstream``, with client-level DP, EF21, or an inner strategy that needs every
        client's weights is refused (ValueError).
    require_compression : bool
        Refuse dense replies (plain weights from a client without ``compression_mod``). Default
        False: a mixed fleet works, each dense reply is validated like a payload (the model's keys,
        shapes and dtypes; finite) and counted as an uncompressed update at its real bytes under
        ``upload-bytes-dense``. Dense replies are always refused under local DP, EF21 and
        ``downstream`` (the node was sent a compressed copy, not the global weights).
    preset : {"lora"}, optional
        Sets ``compressor``, ``error_feedback``, ``downstream``, ``downstream_init`` and
        ``downstream_catchup`` at once (`presets`): ``"lora"`` is sign with error feedback both
        ways and the seeded start of peft adapters, for FlowerTune-style apps. Passing one of those
        arguments with another value as well is refused.
    **params
        Codec parameters by their Python or run-config names: ``density``, ``levels``,
        ``block_size``, ``value_dtype``, ``residual_dtype``, ``batchnorm_stats``, ... Where one is not
        given the run-config key's default applies, except ``batchnorm_stats``: ``"small"`` (BatchNorm's
        running statistics exact both ways; `presets.LIBRARY_CODEC_DEFAULTS`), where the
        reference app's run config says ``"auto"`` (their change as a scaled sign).

    Raises
    ------
    ValueError
        Unknown codec or a parameter out of range (at construction): among them ``max_epsilon``
        that is not a finite number > 0 and ``max_num_examples`` that is not an integer >= 1.
    AttributeError
        Setting a public attribute that neither this wrapper nor the inner strategy has (reads and
        writes of the inner strategy's settings are forwarded to it: `forward`).

    Notes
    -----
    One node, one vote: in ``aggregate_train`` a second reply from a node, and a reply from a node
    that ``configure_train`` did not send a message to, are refused and counted in
    ``rejected-replies`` (`admission`). Under ``local_dp`` the server keeps its own
    integer/bool tensors whatever a reply holds. Client-reported metrics are clamped to ±1e100.
    """

    def __init__(self, inner: Strategy, compressor: str | None = None, error_feedback: bool = True,
                 max_num_examples: int = 10**9, client_dp: ClientLevelDP | None = None,
                 local_dp: LocalDP | None = None, max_epsilon: float | None = None, downstream: str | None = "auto",
                 client_sampling: float | None = None, seed: int | None = None, aggregation: str = "auto",
                 downstream_init: SeededInit | str | None = "auto", require_compression: bool = False,
                 downstream_catchup: str = "smallest", downstream_max_copies: float | None = None,
                 downstream_density: float | None = None, downstream_correction: float = 0.0,
                 preset: str | None = None, **params) -> None:
        if preset is not None:  # one argument for the codecs both ways (strategies/presets.py)
            given = {"compressor": compressor, "error_feedback": error_feedback, "downstream": downstream,
                     "downstream_init": downstream_init, "downstream_catchup": downstream_catchup}
            given = apply_preset(preset, given, _DEFAULTS)
            compressor, error_feedback, downstream = given["compressor"], given["error_feedback"], given["downstream"]
            downstream_init, downstream_catchup = given["downstream_init"], given["downstream_catchup"]
        compressor = "stc" if compressor is None else compressor  # None: the default, "stc" (a preset may set it)
        if downstream == "auto":  # both ways by default (`presets.library_downstream`)
            downstream, downstream_density = library_downstream(compressor, downstream_density, local_dp, inner)
        if aggregation not in ("auto", "dense"):
            raise ValueError(f"aggregation must be 'auto' or 'dense', got {aggregation!r}")
        if not isinstance(inner, Strategy):
            raise TypeError(f"inner must be a flwr.serverapp.strategy.Strategy, got {type(inner).__name__}")
        self.inner = inner
        #: The concern this wrapper adds: the codec clients are asked for (``params``: its options).
        self.codec = CodecConfig.from_kwargs(compressor, error_feedback, **library_codec_params(params))
        try:
            check_feedback_under_dp(self.codec, inner)
        except ValueError as err:
            raise ValueError(f"preset {preset!r} keeps error feedback: {err}" if preset else str(err)) from None
        self.max_num_examples = check_max_num_examples(max_num_examples)
        if not isinstance(require_compression, bool):
            raise ValueError(f"require_compression must be True or False, got {require_compression!r}")
        self.require_compression = require_compression
        self.aggregation = aggregation
        self.folding = FoldPolicy(inner, aggregation)
        # -- the concerns it carries, each an object of its own --------------------------
        self.budget = PrivacyBudget(client_dp, local_dp, max_epsilon)
        self.sampling = None if client_sampling is None else PoissonSampling(client_sampling, seed)
        self.ef21 = (EF21Aggregate.for_strategy(inner, client_dp, aggregation)
                     if self.codec.error_feedback == "ef21" else None)
        why = correction_refusal(check_correction(downstream_correction), downstream not in (None, "none"),
                                 client_dp is not None, self.ef21 is not None, streams(inner), aggregation == "dense")
        if why:
            raise ValueError(f"downstream_correction = {downstream_correction!r} cannot apply: {why}")
        check_max_copies(downstream_max_copies)  # also without a downstream codec: a bad value is named, not ignored
        self.downstream = Downstream.for_run(self.codec, downstream, init=downstream_init, catchup=downstream_catchup,
                                             max_copies=downstream_max_copies, density=downstream_density,
                                             correction=downstream_correction)
        #: The concerns that see each message and reply of a round (`round_hooks`), in calling order.
        self.hooks = [] if self.downstream is None else [DownloadHook(self.downstream, correct=self.ef21 is None)]
        self.rounds = RoundHistory()
        #: The serialised bytes of every message both ways, and their fp32 equivalent (`wire_bytes`).
        self.wire = WireCount()
        #: The dense global model of the current round (what a plain app's messages would carry).
        self._round_arrays: ArrayRecord | None = None
        # -- what a round leaves for the next call ----------------------------------------
        #: The global model sent in the current round (set by `configure_train`).
        self.sent_round: SentRound | None = None
        #: The evaluate messages of the current round (set by `configure_evaluate`).
        self._evaluate_sent: list[Message] = []
        #: Rounding remainder of the integer rule per integer tensor, carried from round to round
        #: (float64, entries in [-0.5, 0.5]; see `fedcomp.statedict.integer_mean`).
        self.int_remainders: dict[str, np.ndarray] = {}
        #: Rounding remainder of each fp16/bf16 float tensor, carried from round to round (float32,
        #: ``|r| <=`` half an ulp; see `fedcomp.statedict.cast_carried`): updates below half an
        #: ulp still move a half-precision model.
        self.half_remainders: dict[str, np.ndarray] = {}
        #: Names holding one tensor, tied in every aggregate (None: found in the first global model; [] ties none).
        self.tied_groups: list[tuple[str, ...]] | None = None
        self._start_forwarding()  # from here on, settings of the inner strategy reach it (`forward`)

    @classmethod
    def from_codec_config(cls, inner: Strategy, codec: CodecConfig, **options) -> CompressedStrategy:
        """Build from a parsed `fedcomp.config.CodecConfig` (e.g. from the run config);
        ``options`` are the other constructor arguments (``client_dp``, ``max_epsilon``, ...)."""
        params = {k.replace("-", "_"): v for k, v in codec.to_mapping().items()}
        return cls(inner, **params, **options)

    # -- the per-round figures, kept by the history ---------------------------------------
    history = _history("train")
    client_history = _history("clients")
    layer_history = _history("layers")
    failure_history = _history("failures")
    evaluate_history = _history("evaluate")
    evaluate_failure_history = _history("evaluate_failures")

    # -- the privacy settings, kept by the budget ----------------------------------------
    client_dp = _budget("client_dp", "Client-level DP-FedAvg (None: the inner strategy aggregates).")
    local_dp = _budget("local_dp", "Local DP settings sent to clients (None: none).")
    max_epsilon = _budget("max_epsilon", "The privacy budget (None: none).")
    stopped_reason = _budget("stopped_reason", 'Why no further rounds are run ("" while rounds go on).')

    @property
    def poisson_rate(self) -> float | None:
        """Poisson client-sampling rate q (None: the inner strategy's sample is kept)."""
        return None if self.sampling is None else self.sampling.rate

    def summary(self) -> None:
        """Log the codec, then the inner strategy's summary."""
        log(INFO, "\t├──> CompressedStrategy: %s", self.codec.describe())
        self.inner.summary()

    # -- configure: ask each concern ------------------------------------------------------
    def remember(self, server_round: int, model: FlatModel, sampled: float = 0.0,
                 nodes: set[int] | None = None) -> None:
        """Record the global model sent in ``server_round`` (what
        [`configure_train`][fedcomp.strategies.CompressedStrategy.configure_train] does; public for callers that build
        the round's replies themselves; ``nodes`` None: any node's first reply counts)."""
        self.sent_round = SentRound(server_round, model, sampled, nodes)
        if self.tied_groups is None:  # equal random-looking tensors of the first model: one under several names
            self.tied_groups = find_tied(model)

    def start(self, grid: Grid, initial_arrays: ArrayRecord, *args, **kwargs):
        """Flower's strategy loop (`flwr.serverapp.strategy.Strategy.start`), from the initial
        model the downstream sender starts from (seeded where ``downstream_init`` says:
        `fedcomp.download.sender.Downstream.start_model`), so that round 0's evaluation and
        round 1 see the model new clients build."""
        if self.tied_groups is None:  # before a seeded start draws each name apart
            self.tied_groups = find_tied(FlatModel.from_record(initial_arrays))
        for hook in self.hooks:
            initial_arrays = hook.on_start(initial_arrays)
        return super().start(grid, initial_arrays, *args, **kwargs)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Add the codec in force (and local-DP settings) to ``config``, remember ``arrays``, delegate,
        then Poisson-sample the inner strategy's messages and let the downstream sender fill them.

        Sends nothing (an empty round) once the privacy budget ``max_epsilon`` would be exceeded.
        """
        if server_round == 1:
            check_model(self.codec, arrays)
        self.history.setdefault(server_round, {})
        self.remember(server_round, FlatModel.from_record(arrays), nodes=set())
        if self.budget.exhausted(server_round):
            return []
        add_codec(self.codec, server_round, config)
        self.budget.train_config(config)
        msgs = list(self.inner.configure_train(server_round, arrays, config, grid))
        self.sent_round.sampled = len(msgs)
        if self.sampling is not None:
            msgs, self.sent_round.sampled = self.sampling.sample(msgs)
        self.sent_round.nodes = {m.metadata.dst_node_id for m in msgs}
        self.sent_round.messages = msgs
        for hook in self.hooks:
            hook.on_configure(server_round, arrays, msgs, "train")
        self._round_arrays = arrays
        self.wire.sent(server_round, "train", msgs, arrays)
        return msgs

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Delegate; with ``downstream``, the evaluate messages ride the compressed download as train
        messages do (`fedcomp.download.sender.Downstream.prepare`: each node gets the step or catch-up
        that brings its copy to the round's model, never the model dense); their bytes are counted."""
        self._evaluate_sent = list(self.inner.configure_evaluate(server_round, arrays, config, grid))
        for hook in self.hooks:
            hook.on_configure(server_round, arrays, self._evaluate_sent, "evaluate")
        self.wire.sent(server_round, "evaluate", self._evaluate_sent, arrays)
        return self._evaluate_sent

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Delegate, one reply per node sent an evaluate message (`replies.evaluate_replies`); the
        result is also kept in ``evaluate_history[server_round]``, and clients that failed to evaluate
        (error replies charged to their sender, sampled nodes that sent nothing) in
        ``evaluate_failure_history`` (logged with the reason)."""
        sent_to = {m.metadata.message_id: m.metadata.dst_node_id for m in self._evaluate_sent}
        replies = list(replies)
        self.wire.received(server_round, "evaluate", replies, None)
        self._note_wire(server_round)
        replies, self.evaluate_failure_history[server_round] = evaluate_replies(server_round, sent_to, replies)
        for hook in self.hooks:  # the download: a node that answered holds the copy it evaluated
            hook.on_replies(server_round, "evaluate", replies)
        metrics = self.inner.aggregate_evaluate(server_round, replies)
        if metrics is not None:
            ok = sum(1 for r in replies if not r.has_error())
            self.evaluate_history[server_round] = {**dict(metrics), "num-replies": float(ok)}
        return metrics

    # -- aggregate: admit -> decode -> fold -> hand over -> record ----------------------------
    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode and validate every reply, fold it into the aggregate, hand the result to ``inner``.

        Orchestration only: admit (`admission`, EF21's state check) -> decode, validate and fold
        (`replies.fold_replies`, a policy of `aggregate`) -> the round's bookkeeping
        (failures; the downstream's record of what each node holds, with the downstream correction,
        `fedcomp.download.correction`, as each reply is committed; EF21's estimate) -> hand over
        (`handover.hand_over`: the inner strategy, dtypes, the integer/bool rule) -> metrics
        and the privacy accounting of the round.
        """
        sent = self.sent_round
        if sent is None or sent.server_round != server_round:
            raise RuntimeError(f"aggregate_train for round {server_round} without configure_train")
        replies = list(replies)
        self.wire.received(server_round, "train", replies, self._round_arrays)
        replies, refused, mismatched = self._admit(server_round, sent, replies)
        fold = self.folding.new_fold(sent.model, len(replies), self.client_dp, self.int_remainders)
        refuse_dense = dense_refusal(self.require_compression, self.local_dp, self.ef21, self.downstream)
        got = fold_replies(server_round, replies, fold, sent.model, weight_key(self.inner), self.max_num_examples,
                           refuse_dense, keep_exact=self.local_dp is None)  # local DP: the server keeps its own
        ef21_missing = self._bookkeeping(server_round, sent, replies, refused, mismatched, got)
        common_metric_keys(got.metric_contents)
        # BatchNorm statistics sent as a scaled sign ("auto"): a running variance falls at most to VAR_FLOOR
        signed = self.codec.for_round(server_round).batchnorm_stats_codec() == BATCHNORM_STATS_CODEC
        var_floor = VAR_FLOOR if signed else 0.0
        arrays, agg_metrics, dp_info = hand_over(self.inner, server_round, sent.model, got, sent.sampled,
                                                   self.half_remainders, var_floor, self.tied_groups or ())
        ours = self._record(server_round, sent, got, bool(replies), dp_info, ef21_missing)
        # the headline names are the wrapper's: an average of client-reported values under one of them
        # (a client's own ``epsilon``, a planted ``epsilon-max``) never stands in for a figure it did not compute
        merged = {k: v for k, v in (agg_metrics or {}).items() if k not in HEADLINE_KEYS}
        merged.update(headline(ours))  # the rest of the round's figures: self.history
        return arrays, MetricRecord(merged)

    def _admit(self, server_round: int, sent: SentRound, replies: list[Message]) -> tuple[list, list, list]:
        """One node, one vote (duplicates, strangers and replies to a message this round did not send
        refused, `admission`), then a fixed order
        (by node id): float sums, and so runs, do not depend on arrival order; then EF21's check that
        each node's ``h_i`` is the one the server's ``h`` holds. Returns (admitted, ``(reply, why)``
        refused, ``(reply, failure record)`` refused by EF21).

        Error replies carry no update (no vote) and count as failed clients with their reason: Flower
        answers a task it lost (e.g. a ClientApp the OOM killer took) from the SuperLink's node id,
        which the stranger check would misreport as a reply "not sent a message this round".
        """
        errors = [r for r in replies if r.has_error()]
        # what each reply answers is checked once the round's messages have their ids (a grid pushed them)
        sent_to = sent.sent_to() if sent.messages and all(m.metadata.message_id for m in sent.messages) else None
        replies, refused = admit([r for r in replies if not r.has_error()], lambda r: r.metadata.src_node_id,
                                 sent.nodes, lambda r: r.metadata.reply_to_message_id, sent_to)
        for hook in self.hooks:  # the download: a node sent a compressed copy reports the copy it holds
            out = hook.admit(server_round, replies)
            refused += out
            replies = [r for r in replies if not any(r is u for u, _ in out)]
        for reply, why in refused:
            log(WARNING, "round %s: rejected reply from node %s: %s", server_round, reply.metadata.src_node_id, why)
        replies = errors + sorted(replies, key=lambda r: r.metadata.src_node_id)
        mismatched = []
        if self.ef21 is not None:
            replies, mismatched = self.ef21.check_replies(server_round, replies)
        return replies, refused, mismatched

    def _bookkeeping(self, server_round: int, sent: SentRound, replies: list[Message], refused: list,
                     mismatched: list, got: RoundReplies) -> int | None:
        """Name the round's failed clients, tell the downstream sender who replied (which, with a
        downstream correction, folds each reply's ``c * w * (H_i - G)`` into ``got.fold``), fold the sends
        into EF21's estimate and let the budget see refusals; returns EF21's count of missing clients."""
        got.failures.extend(failure for _, failure in mismatched)  # EF21: a named failure each
        note_failures(server_round, sent.nodes, sent.sent_to(), replies, [r for r, _ in refused + mismatched], got,
                      self.rounds.oom_seen)
        self.failure_history[server_round] = got.failures
        got.rejected += len(refused)
        for hook in self.hooks:  # the download: what each node holds, its charge, the correction
            hook.on_replies(server_round, "train", replies, got, sent)
        if self.downstream is None:  # the bytes this server sent each node, not what the node reports
            sent_bytes = {m.metadata.dst_node_id: sum(len(a.data) for r in m.content.array_records.values()
                                                      for a in r.values()) for m in sent.messages}
            for stat in got.stats:
                reported = max(stat["download-bytes"], 0.0)  # a reply without a sent message (tests): its word
                stat["download-bytes"] = float(sent_bytes.get(stat["node"], reported))
        ef21_missing = None
        if self.ef21 is not None:  # EF21: the round's update is the server's estimate h (+= mean of the sends)
            asked = len(sent.nodes) if sent.nodes is not None else len(replies) + len(refused)
            ef21_missing = self.ef21.round_update(server_round, got.fold.running, asked,
                                                  [st["node"] for st in got.stats])
        self.budget.note_refusals(server_round, replies)
        return ef21_missing

    def _record(self, server_round: int, sent: SentRound, got: RoundReplies, any_replies: bool,
                dp_info: dict, ef21_missing: int | None) -> dict[str, float]:
        """The wrapper's round metrics (`round_metrics.round_metrics`), accounted by the budget
        and kept in the history."""
        self.rounds.note_machines(got.stats)
        ours = round_metrics(got.stats, got.codec_bytes, len(got.metric_contents), got.rejected, got.failed)
        ours.update(dp_info)
        if ef21_missing is not None:
            ours["ef21-missing-clients"] = float(ef21_missing)
        if got.uncharged:
            ours["uncharged-error-replies"] = float(got.uncharged)
        for hook in self.hooks:
            ours.update(hook.round_metrics())
        self.budget.account(server_round, any_replies, got.stats, ours)
        self.rounds.record_train(server_round, ours, got.stats, layers_mean(got.layer_stats, sent.model.float_keys))
        self._note_wire(server_round)
        return ours

    def _note_wire(self, server_round: int) -> None:
        """Put the round's wire figures (`wire_bytes`, evaluation included once it ran) in ``history``."""
        if server_round in self.history:
            self.history[server_round].update(self.wire.get(server_round))

    # -- state for checkpoints -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs: ``{"privacy": JSON-serialisable accounting,
        "optimizer": {name: np.ndarray} of the inner strategy's server optimizer,
        "int-remainders": {tensor: float64 np.ndarray} of the integer rule,
        "half-remainders": {tensor: float32 np.ndarray} of the fp16/bf16 tensors' rounding,
        "ef21": {tensor: flat float64 np.ndarray} EF21's server estimate h (empty without EF21),
        "ef21-folded": {"nodes", "rounds"} the round each node's send was last folded into h}``."""
        return {"privacy": self.budget.state_dict(), "optimizer": optimizer_state(self.inner),
                "int-remainders": {k: np.array(v, copy=True) for k, v in self.int_remainders.items()},
                "half-remainders": {k: np.array(v, copy=True) for k, v in self.half_remainders.items()},
                "ef21": self.ef21.state_dict() if self.ef21 is not None else {},
                "ef21-folded": self.ef21.folded_state() if self.ef21 is not None else {}}

    def load_state_dict(self, state: dict[str, Any], shapes: dict[str, tuple]) -> None:
        """Restore [`state_dict`][fedcomp.strategies.CompressedStrategy.state_dict]; ``shapes``: the model's tensor
        shapes (model order).

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
            self.ef21.load_state_dict(ef21, shapes, state.get("ef21-folded"))
        self.budget.load_state_dict(state.get("privacy", {}))
        self.int_remainders = dict(state.get("int-remainders", {}))
        self.half_remainders = dict(state.get("half-remainders", {}))  # none in older checkpoints: zero


#: The constructor's defaults (what a preset may fill in).
_DEFAULTS = {name: p.default for name, p in inspect.signature(CompressedStrategy.__init__).parameters.items()
             if p.default is not inspect.Parameter.empty}


__all__ = ["CompressedStrategy", "SentRound"]
