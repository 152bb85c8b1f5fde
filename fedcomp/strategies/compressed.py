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
from fedcomp.download.layout import VAR_FLOOR
from fedcomp.download.options import Download
from fedcomp.protocol.round_hooks import Refusal
from fedcomp.statedict import FlatModel
from fedcomp.statedict.tied import find_tied
from fedcomp.strategies.admission import Admission
from fedcomp.strategies.codec_round import add_codec, check_model
from fedcomp.strategies.composition import CONCERN_SETTINGS, check_codec_params, compose
from fedcomp.strategies.fold_policy import FoldPolicy, dense_refusal
from fedcomp.strategies.forward import ForwardsToInner
from fedcomp.strategies.handover import hand_over, weight_key
from fedcomp.strategies.presets import apply_preset, library_codec_params
from fedcomp.strategies.privacy_budget import PoissonSampling, Privacy
from fedcomp.strategies.replies import RoundReplies, evaluate_replies, fold_replies, note_failures
from fedcomp.strategies.round_history import HistoryViews, RoundHistory, SentRound
from fedcomp.strategies.round_metrics import HEADLINE_KEYS, common_metric_keys, headline, layers_mean, round_metrics
from fedcomp.strategies.wire_bytes import WireCount
from fedcomp.strategies.wrapping import load_optimizer_state, optimizer_state

def _setting(concern: str, name: str, doc: str) -> property:
    """A read-only view of a setting of one of the concerns (set at construction, checked there)."""
    return property(lambda self: getattr(getattr(self, concern), name), _read_only(name), doc=doc)


def _concern(name: str, doc: str) -> property:
    """One of the concerns (read-only: the hooks hold it)."""
    return property(lambda self: getattr(self._concerns, name), _read_only(name), doc=doc)


def _read_only(name: str):
    def refuse(self, value) -> None:
        raise AttributeError(f"CompressedStrategy.{name} is set at construction (checked there against the other "
                             "concerns): build a new strategy with the setting you want")
    return refuse


class CompressedStrategy(HistoryViews, ForwardsToInner, Strategy):
    """Wrap any Message-API strategy so that clients send compressed updates, and the model travels
    compressed both ways.

    Like Flower's DP wrappers, it adds one concern, the codec, and delegates the rest: it decodes each
    reply produced by [`fedcomp.client.compression_mod`][] (validated before it touches the aggregate),
    folds it into one running sum (O(model) memory for any number of clients) where ``inner`` aggregates
    by a weighted mean, and hands ``inner`` one pre-aggregated reply, which gives it the same result;
    other inner strategies get every reply as dense weights. The other concerns are objects of their
    own, called as round hooks (`fedcomp.protocol.round_hooks`) in the order `composition` gives:
    admission, privacy, Poisson sampling, the download (`fedcomp.download`), EF21. The round's figures
    are kept in ``history[round]`` and the other histories (`round_history`; the keys are listed in
    the metrics reference); Flower's MetricRecord holds the inner strategy's average of the app's own
    client metrics and the headline figures (`round_metrics.HEADLINE_KEYS`).

    Parameters
    ----------
    inner : Strategy
        Any Message-API strategy: FedAvg, FedAdam, FedProx, Flower's DP wrappers, ... It only ever
        receives dense, validated replies.
    compressor : str
        Codec name (`fedcomp.compression.available_compressors`). Default (None) "stc".
    error_feedback : bool or "ef21"
        Clients keep a residual (Karimireddy et al. 2019). Default True. "ef21": clients send
        ``C(update - h_i)`` and the server applies its estimate ``h`` (Richtárik et al. 2021;
        `ef21_aggregate`).
    downstream : Download or str or None
        The download (`fedcomp.download.Download`; a string is its codec, None or "none" dense).
        Default "auto": the upload codec's counterpart with server-side error feedback (`sign` for
        sign uploads, STC at five times the density for sparse ones up to 0.25, int8 for the others:
        `presets.library_downstream`), dense for ``compressor="none"``, under local DP and for inner
        strategies that need every client's weights. Evaluate messages travel the same way, and a node
        that already holds the latest broadcast gets no step. Needs ``compression_mod`` on every client.
    privacy : Privacy, optional
        Client-level DP, local DP and the epsilon budget (`privacy_budget.Privacy`). Default: none.
    sampling : PoissonSampling, optional
        Poisson client sampling (`privacy_budget.PoissonSampling`; the inner strategy should select
        every node): privacy amplification by sampling for client-level DP.
    admission : Admission, optional
        Which replies count (`admission.Admission`: one node, one vote; the largest ``num-examples``
        a reply may claim, default 10**9; whether dense replies are refused, default not).
    aggregation : {"auto", "dense"}
        "auto" (default): fold into one running sum where ``inner`` allows; "dense": every reply as
        dense weights (for checks).
    preset : {"lora"}, optional
        Sets ``compressor``, ``error_feedback`` and ``downstream`` at once (`presets`): sign with error
        feedback both ways and the seeded start of peft adapters. Passing one of those with another
        value as well is refused.
    **params
        Codec parameters by their Python or run-config names: ``density``, ``levels``, ``block_size``,
        ``value_dtype``, ``residual_dtype``, ``batchnorm_stats`` (default ``"small"``: BatchNorm's
        running statistics exact both ways, `presets.LIBRARY_CODEC_DEFAULTS`), ...

    Raises
    ------
    ValueError
        Unknown codec, a parameter out of range, or concerns that cannot apply together (`composition`).
    TypeError
        ``inner`` or a concern of the wrong type.
    AttributeError
        Setting a public attribute that neither this wrapper nor the inner strategy has (settings of
        the inner strategy are forwarded to it: `forward`).
    """

    _SETTING_HINTS = CONCERN_SETTINGS

    def __init__(self, inner: Strategy, compressor: str | None = None, error_feedback: bool | str = True, *,
                 downstream: Download | str | None = "auto", privacy: Privacy | None = None,
                 sampling: PoissonSampling | None = None, admission: Admission | None = None,
                 aggregation: str = "auto", preset: str | None = None, **params) -> None:
        check_codec_params(params)
        given = apply_preset(preset, {"compressor": compressor, "error_feedback": error_feedback,
                                      "downstream": Download.of(downstream)}, _DEFAULTS)
        compressor = "stc" if given["compressor"] is None else given["compressor"]
        self.inner = inner
        #: The concern this wrapper adds: the codec clients are asked for (``params``: its options).
        self.codec = CodecConfig.from_kwargs(compressor, given["error_feedback"], **library_codec_params(params))
        self._concerns = compose(inner, self.codec, given["downstream"], privacy, sampling, admission, aggregation,
                                 preset)
        self.aggregation = aggregation
        self.folding = FoldPolicy(inner, aggregation)
        self.rounds = RoundHistory()
        #: The serialised bytes of every message both ways, and their fp32 equivalent (`wire_bytes`).
        self.wire = WireCount()
        #: The round's global model and train messages (set by `configure_train`), its evaluate messages.
        self.sent_round: SentRound | None = None
        self._round_arrays: ArrayRecord | None = None
        self._evaluate_sent: list[Message] = []
        #: Carried rounding remainders: the integer rule's per integer tensor (float64, in [-0.5, 0.5];
        #: `fedcomp.statedict.integer_mean`) and each fp16/bf16 tensor's (float32, at most half an ulp;
        #: `fedcomp.statedict.cast_carried`: updates below half an ulp still move a half-precision model).
        self.int_remainders: dict[str, np.ndarray] = {}
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

    # -- the concerns, and their settings where users look for them -------------------------
    admission = _concern("admission", "Which replies count (`admission.Admission`).")
    privacy = _concern("privacy", "DP and the epsilon budget (`privacy_budget.Privacy`).")
    sampling = _concern("sampling", "Poisson client sampling (None: the inner strategy's sample is kept).")
    download = _concern("download", "The download as resolved (`fedcomp.download.Download`).")
    downstream = _concern("downstream", "The download's sender (None: the model travels dense).")
    ef21 = _concern("ef21", "EF21's server estimate (None: no EF21).")
    hooks = _concern("hooks", "The concerns that see each message and reply of a round, in calling order.")
    client_dp = _setting("privacy", "client_dp", "Client-level DP-FedAvg (None: the inner strategy aggregates).")
    local_dp = _setting("privacy", "local_dp", "Local DP settings sent to clients (None: none).")
    max_epsilon = _setting("privacy", "max_epsilon", "The privacy budget (None: none).")
    stopped_reason = _setting("privacy", "stopped_reason", 'Why no further rounds are run ("" while rounds go on).')
    max_num_examples = _setting("admission", "max_num_examples", "Largest ``num-examples`` a reply may claim.")
    require_compression = _setting("admission", "require_compression", "Whether dense replies are refused.")

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
        """Add the codec in force to ``config``, remember ``arrays``, delegate, then let each hook see the
        messages (Poisson sampling keeps some; the download rewrites them). Sends nothing (an empty
        round) once a hook says so (the privacy budget ``max_epsilon``)."""
        if server_round == 1:
            check_model(self.codec, arrays)
        self.history.setdefault(server_round, {})
        self.remember(server_round, FlatModel.from_record(arrays), nodes=set())
        if not all(hook.configure(server_round, "train", config) for hook in self.hooks):
            return []
        add_codec(self.codec, server_round, config)
        msgs = list(self.inner.configure_train(server_round, arrays, config, grid))
        sent = self.sent_round
        sent.sampled = len(msgs)
        for hook in self.hooks:
            msgs = hook.on_messages(server_round, "train", arrays, msgs, sent)
        sent.nodes, sent.messages = {m.metadata.dst_node_id for m in msgs}, msgs
        self._round_arrays = arrays
        self.wire.sent(server_round, "train", msgs, arrays)
        return msgs

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Delegate; the evaluate messages ride the download as train messages do (each node gets the
        step that brings its copy to the round's model); their bytes are counted."""
        for hook in self.hooks:
            hook.configure(server_round, "evaluate", config)
        msgs = list(self.inner.configure_evaluate(server_round, arrays, config, grid))
        for hook in self.hooks:
            msgs = hook.on_messages(server_round, "evaluate", arrays, msgs)
        self._evaluate_sent = msgs
        self.wire.sent(server_round, "evaluate", msgs, arrays)
        return msgs

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Delegate, one reply per node sent an evaluate message (`replies.evaluate_replies`); the
        result is also kept in ``evaluate_history[server_round]``, and clients that failed to evaluate
        in ``evaluate_failure_history`` (logged with the reason)."""
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

    # -- aggregate: admit -> decode and fold -> the hooks -> hand over -> record ----------------
    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode and validate every reply, fold it into the aggregate, hand the result to ``inner``.

        Orchestration only: the hooks admit (one node, one vote; the copy digest; EF21's state) ->
        decode, validate and fold in node-id order (`replies.fold_replies`, a fold of `aggregate`) ->
        the round's failures, then each hook sees the folded replies (the download's record of what
        each node holds, with its correction; EF21's estimate; the budget) -> hand over
        (`handover.hand_over`: the inner strategy, dtypes, the integer/bool rule, tied names) -> the
        round's metrics, each hook adding its own.
        """
        sent = self.sent_round
        if sent is None or sent.server_round != server_round:
            raise RuntimeError(f"aggregate_train for round {server_round} without configure_train")
        replies = list(replies)
        self.wire.received(server_round, "train", replies, self._round_arrays)
        replies, refused = self._admit(server_round, sent, replies)
        fold = self.folding.new_fold(sent.model, len(replies), self.client_dp, self.int_remainders)
        refuse_dense = dense_refusal(self.require_compression, self.local_dp, self.ef21, self.downstream)
        folded = fold_replies(server_round, replies, fold, sent.model, weight_key(self.inner), self.max_num_examples,
                           refuse_dense, keep_exact=self.local_dp is None)  # local DP: the server keeps its own
        note_failures(server_round, sent.nodes, sent.sent_to(), replies, refused, folded, self.rounds.oom_seen)
        self.failure_history[server_round] = folded.failures
        for hook in self.hooks:
            hook.on_replies(server_round, "train", replies, folded, sent)
        common_metric_keys(folded.metric_contents)
        # BatchNorm statistics sent as a scaled sign ("auto"): a running variance falls at most to VAR_FLOOR
        signed = self.codec.for_round(server_round).batchnorm_stats_codec() == BATCHNORM_STATS_CODEC
        arrays, agg_metrics, dp_info = hand_over(self.inner, server_round, sent.model, folded, sent.sampled,
                                                 self.half_remainders, VAR_FLOOR if signed else 0.0,
                                                 self.tied_groups or ())
        figures = self._record(server_round, sent, folded, dp_info)
        # the headline names are the wrapper's: an average of client-reported values under one of them
        # (a client's own ``epsilon``, a planted ``epsilon-max``) never stands in for a figure it did not compute
        merged = {k: v for k, v in (agg_metrics or {}).items() if k not in HEADLINE_KEYS}
        merged.update(headline(figures))  # the rest of the round's figures: self.history
        return arrays, MetricRecord(merged)

    def _admit(self, server_round: int, sent: SentRound, replies: list[Message]) -> tuple[list, list[Refusal]]:
        """Each hook's refusals among the replies the previous hooks admitted (logged, unless a named
        failure), then a fixed order (by node id): float sums, and so runs, do not depend on arrival
        order. Returns (error replies + admitted replies, refusals).

        Error replies carry no update (no vote) and count as failed clients with their reason: Flower
        answers a task it lost (e.g. a ClientApp the OOM killer took) from the SuperLink's node id,
        which the stranger check would misreport as a reply "not sent a message this round".
        """
        errors = [r for r in replies if r.has_error()]
        replies = sorted((r for r in replies if not r.has_error()), key=lambda r: r.metadata.src_node_id)
        refused: list[Refusal] = []
        for hook in self.hooks:
            out = hook.admit(server_round, replies, sent)
            refused += out
            replies = [r for r in replies if not any(r is x.reply for x in out)]
        for refusal in refused:
            if refusal.failure is None:
                log(WARNING, "round %s: rejected reply from node %s: %s", server_round,
                    refusal.reply.metadata.src_node_id, refusal.reason)
        return errors + replies, refused

    def _record(self, server_round: int, sent: SentRound, folded: RoundReplies, dp_info: dict) -> dict[str, float]:
        """The wrapper's round metrics (`round_metrics.round_metrics`), each hook's figures added, kept
        in the history."""
        self.rounds.note_machines(folded.stats)
        figures = round_metrics(folded.stats, folded.codec_bytes, len(folded.metric_contents), folded.rejected,
                                folded.failed)
        figures.update(dp_info)
        if folded.uncharged:
            figures["uncharged-error-replies"] = float(folded.uncharged)
        for hook in self.hooks:
            hook.on_round_end(server_round, figures, folded)
        layers = layers_mean(folded.layer_stats, sent.model.float_keys)
        self.rounds.record_train(server_round, figures, folded.stats, layers)
        self._note_wire(server_round)
        return figures

    def _note_wire(self, server_round: int) -> None:
        """Put the round's wire figures (`wire_bytes`, evaluation included once it ran) in ``history``."""
        if server_round in self.history:
            self.history[server_round].update(self.wire.get(server_round))

    # -- state for checkpoints -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs: ``{"optimizer": {name: np.ndarray} of the inner strategy's server
        optimizer, "int-remainders": {tensor: float64 np.ndarray} of the integer rule, "half-remainders":
        {tensor: float32 np.ndarray} of the fp16/bf16 tensors' rounding}`` and each hook's state:
        ``"privacy"`` (JSON-serialisable accounting), ``"ef21"`` ({tensor: flat float64 np.ndarray}, EF21's
        server estimate h) and ``"ef21-folded"`` (``{"nodes", "rounds"}``; both empty without EF21)."""
        state = {"optimizer": optimizer_state(self.inner), "ef21": {}, "ef21-folded": {},
                 "int-remainders": {k: np.array(v, copy=True) for k, v in self.int_remainders.items()},
                 "half-remainders": {k: np.array(v, copy=True) for k, v in self.half_remainders.items()}}
        for hook in self.hooks:
            state.update(hook.state_dict())
        return state

    def load_state_dict(self, state: dict[str, Any], shapes: dict[str, tuple]) -> None:
        """Restore [`state_dict`][fedcomp.strategies.CompressedStrategy.state_dict]; ``shapes``: the model's
        tensor shapes (model order).

        Raises
        ------
        ValueError
            Optimizer state the inner strategy does not have or that does not fit ``shapes``; an
            EF21 estimate without EF21, or one that does not fit ``shapes``.
        """
        load_optimizer_state(self.inner, state.get("optimizer", {}), shapes)
        if state.get("ef21") and self.ef21 is None:
            raise ValueError("the checkpoint holds EF21's server estimate h but error-feedback is not 'ef21'")
        for hook in self.hooks:
            hook.load_state_dict(state, shapes)
        self.int_remainders = dict(state.get("int-remainders", {}))
        self.half_remainders = dict(state.get("half-remainders", {}))  # none in older checkpoints: zero


#: The constructor's defaults (what a preset may fill in), the download as the object it becomes.
_DEFAULTS = {name: p.default for name, p in inspect.signature(CompressedStrategy.__init__).parameters.items()
             if p.default is not inspect.Parameter.empty}
_DEFAULTS["downstream"] = Download.of(_DEFAULTS["downstream"])


__all__ = ["CompressedStrategy", "SentRound"]
