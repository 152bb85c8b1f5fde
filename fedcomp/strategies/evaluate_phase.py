"""The evaluate phase of `CompressedStrategy`: federated evaluation as the inner strategy configures it,
its messages riding the download as train messages do (each node gets the step that brings its copy to
the round's model, `fedcomp.download.round_hook`), every message counted both ways (`wire_bytes`)."""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid

from fedcomp.strategies.replies import evaluate_replies


class EvaluatePhase:
    """Mixin of `CompressedStrategy`: ``configure_evaluate`` and ``aggregate_evaluate`` over ``inner``,
    ``hooks`` and ``wire``, and the round's wire figures put in ``history``."""

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

    def _note_wire(self, server_round: int) -> None:
        """Put the round's wire figures (`wire_bytes`, evaluation included once it ran) in ``history``."""
        if server_round in self.history:
            self.history[server_round].update(self.wire.get(server_round))


__all__ = ["EvaluatePhase"]
