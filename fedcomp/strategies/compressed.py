"""``CompressedStrategy``: a Message-API strategy wrapper that decodes compressed replies."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from logging import INFO

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedcomp.config import CodecConfig
from fedcomp.config.codec import BATCHNORM_STATS_CODEC
from fedcomp.download.layout import VAR_FLOOR
from fedcomp.download.options import Download
from fedcomp.statedict import FlatModel
from fedcomp.statedict.tied import find_tied
from fedcomp.strategies.admission import Admission, admit_replies
from fedcomp.strategies.codec_round import add_codec, check_model
from fedcomp.strategies.composition import CONCERN_SETTINGS, check_codec_params, compose
from fedcomp.strategies.concern_views import ConcernViews
from fedcomp.strategies.evaluate_phase import EvaluatePhase
from fedcomp.strategies.fold_policy import FoldPolicy, dense_refusal
from fedcomp.strategies.forward import ForwardsToInner
from fedcomp.strategies.handover import hand_over, weight_key
from fedcomp.strategies.presets import apply_preset, library_codec_params
from fedcomp.strategies.privacy_budget import PoissonSampling, Privacy
from fedcomp.strategies.replies import RoundReplies, fold_replies, note_failures
from fedcomp.strategies.round_history import HistoryViews, RoundHistory, SentRound
from fedcomp.strategies.round_metrics import HEADLINE_KEYS, common_metric_keys, headline, layers_mean, round_metrics
from fedcomp.strategies.strategy_state import StrategyState
from fedcomp.strategies.wire_bytes import WireCount


class CompressedStrategy(EvaluatePhase, ConcernViews, StrategyState, HistoryViews, ForwardsToInner, Strategy):
    """Wrap any Message-API strategy so that clients send compressed updates, and the model travels
    compressed both ways.

    Like Flower's DP wrappers, it adds one concern, the codec, and delegates the rest: it decodes each
    reply of [`fedcomp.client.compression_mod`][] (validated first), folds it into one running sum
    (O(model) memory for any number of clients) where ``inner`` takes a weighted mean, and hands
    ``inner`` one pre-aggregated reply with the same result (other inner strategies get every reply
    dense). The other concerns are objects called as round hooks (`fedcomp.protocol.round_hooks`), in
    `composition`'s order: admission, privacy, Poisson sampling, the download (`fedcomp.download`),
    EF21; evaluation is `evaluate_phase`. The round's figures are in ``history[round]`` and the other
    histories (`round_history`); Flower's MetricRecord holds the inner strategy's average of the app's
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

    def summary(self) -> None:
        """Log the codec, then the inner strategy's summary."""
        log(INFO, "\t├──> CompressedStrategy: %s", self.codec.describe())
        self.inner.summary()

    # -- configure: ask each concern ------------------------------------------------------
    def remember(self, server_round: int, model: FlatModel, sampled: float = 0.0,
                 nodes: set[int] | None = None) -> None:
        """Record the global model sent in ``server_round`` (as `configure_train` does; for callers that build the
        round's replies themselves; ``nodes`` None: any node's first reply counts)."""
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
        replies, refused = admit_replies(self.hooks, server_round, replies, sent)  # in node-id order
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


#: The constructor's defaults (what a preset may fill in), the download as the object it becomes.
_DEFAULTS = {name: p.default for name, p in inspect.signature(CompressedStrategy.__init__).parameters.items()
             if p.default is not inspect.Parameter.empty}
_DEFAULTS["downstream"] = Download.of(_DEFAULTS["downstream"])


__all__ = ["CompressedStrategy", "SentRound"]
