"""One round's train replies: each decoded and validated, then folded in or refused, and counted.

A reply is decoded completely (`decode.decode_train_reply`) before anything of it reaches
the fold, so a reply that fails anywhere leaves the aggregate untouched. Error replies (a client
that failed, `failures`) and refused replies are logged with their node id and counted; what the round's
metrics need of the accepted ones (bytes per codec, per-client and per-layer figures) is kept
beside the fold. Used by [`fedcomp.strategies.CompressedStrategy`][].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from logging import WARNING

from flwr.app import Message, MetricRecord, RecordDict
from flwr.common.logger import log

from fedcomp.compression import PayloadError
from fedcomp.protocol.device import reported_machine
from fedcomp.protocol.messages import REPORT_KEYS
from fedcomp.protocol.round_hooks import Refusal
from fedcomp.statedict import FlatModel
from fedcomp.strategies.admission import admit
from fedcomp.strategies.aggregate import Fold
from fedcomp.strategies.decode import decode_train_reply
from fedcomp.strategies.failures import (MAX_REASON_CHARS, MAX_REFUSAL_CHARS, misaddressed_note, oom_confirmations,
                                         printable, round_failures)
from fedcomp.strategies.round_metrics import client_stats


@dataclass
class RoundReplies:
    """The accepted replies of a round, folded, with what the round's metrics need.

    Attributes
    ----------
    fold : Fold
        The round's folding policy (`aggregate`), holding every accepted update.
    template_reply : Message or None
        An accepted reply, whose Message can carry the pre-aggregated reply to the inner strategy.
    metric_contents : list of RecordDict
        One ``{"metrics": MetricRecord}`` per accepted reply (its finite, bounded metrics).
    stats : list of dict
        Per accepted client (`round_metrics.client_stats`).
    layer_stats : list of dict
        Per accepted client, the per-layer lists it reported.
    codec_bytes : dict of str to int
        Payload bytes received per codec name.
    rejected, failed : int
        Replies refused (malformed, duplicate, stranger) and failed clients (error replies, and
        sampled nodes that sent nothing).
    refused_by_hooks : int
        Replies the round hooks refused before decoding (`round_hooks.Refusal`), failures included.
    failures : list of dict
        One per failed client (`failures.failed_client`).
    uncharged : int
        Error replies charged to no node (`failures.round_failures`).
    """

    fold: Fold
    template_reply: Message | None = None
    metric_contents: list[RecordDict] = field(default_factory=list)
    stats: list[dict] = field(default_factory=list)
    layer_stats: list[dict] = field(default_factory=list)
    codec_bytes: dict[str, int] = field(default_factory=dict)
    rejected: int = 0
    refused_by_hooks: int = 0
    failed: int = 0
    failures: list[dict] = field(default_factory=list)
    uncharged: int = 0


def fold_replies(server_round: int, replies: list[Message], fold: Fold, model: FlatModel, weight_key: str,
                 max_num_examples: int, refuse_dense: str = "", keep_exact: bool = True,
                 ) -> RoundReplies:
    """Decode every reply in the given order and fold the good ones into ``fold``.

    Parameters
    ----------
    server_round : int
        For the log.
    replies : list of Message
        The admitted replies, in the order to fold them (error replies are skipped: `note_failures`).
    fold : Fold
        Where accepted updates go (``fold.add(reply, decoded)``).
    model : FlatModel
        The global model the clients were sent.
    weight_key : str
        The metric the inner strategy weights replies by (``num-examples``).
    max_num_examples : int
        Largest weight a reply may claim.
    refuse_dense : str
        Why a dense reply is refused ("": accepted).
    keep_exact : bool
        False: a reply's integer/bool tensors are dropped (local DP: the server keeps its own).
    Returns
    -------
    RoundReplies
    """
    folded = RoundReplies(fold)
    for reply in replies:
        node = reply.metadata.src_node_id
        if reply.has_error():  # counted by `note_failures`
            continue
        try:  # everything is validated before anything is folded in
            decoded = decode_train_reply(reply, model, weight_key, max_num_examples, refuse_dense,
                                         keep_exact=keep_exact)
        except (PayloadError, ValueError, TypeError, KeyError, OverflowError) as exc:
            folded.rejected += 1
            log(WARNING, "round %s: rejected reply from node %s: %s", server_round, node,
                printable(exc, MAX_REFUSAL_CHARS))
            continue
        folded.fold.add(reply, decoded)
        folded.template_reply = reply
        folded.stats.append(client_stats(node, decoded.reported, decoded.update.upload_bytes, model.dense_bytes,
                                      decoded.decode_seconds, reported_machine(reply.content)))
        if folded.stats[-1]["device-report-dropped"]:
            log(WARNING, "round %s: node %s's memory report dropped (counted in dropped-device-reports): %s",
                server_round, node, folded.stats[-1]["device-report-dropped"])
        # what the inner strategy averages: the app's own metrics; compression_mod's report is in folded.stats
        metrics = {k: v for k, v in decoded.metrics.items() if k not in REPORT_KEYS}
        folded.metric_contents.append(RecordDict({"metrics": MetricRecord(metrics)}))
        for name, nbytes in decoded.update.codecs.items():
            folded.codec_bytes[name] = folded.codec_bytes.get(name, 0) + nbytes
        folded.layer_stats.append(decoded.layers)
    return folded


def note_failures(server_round: int, sent_nodes: set[int] | None, sent_to: dict[str, int], replies: list[Message],
                  refused: list[Refusal], folded: RoundReplies, oom_seen: dict[int, int]) -> None:
    """Count the refusals (a named failure each where the hook gave one, else a rejected reply), count and
    name each failed client once (`failures.round_failures`: an error reply charged to the node that sent
    it, a sampled node that sent nothing), log an error reply charged to nobody as such, and name a node
    whose container's OOM-kill count went up (`failures.oom_confirmations`).

    Parameters
    ----------
    sent_nodes : set of int or None
        The nodes sent a train message this round (None: unknown, no node counts as silent).
    sent_to : dict
        Message id -> destination node id of the round's train messages.
    replies : list of Message
        The round's admitted replies (error replies included).
    refused : list of Refusal
        The replies the round hooks refused.
    folded : RoundReplies
        Of `fold_replies`; ``failed`` and ``failures`` grow by the failed clients, ``rejected`` by the
        refusals without a failure record, ``uncharged`` by the error replies charged to nobody.
    oom_seen : dict
        Node -> the last ``client-oom-kills`` it reported; updated in place.
    """
    folded.failures.extend(r.failure for r in refused if r.failure is not None)
    folded.rejected += sum(1 for r in refused if r.failure is None)
    folded.refused_by_hooks = len(refused)
    answered = {r.metadata.src_node_id for r in replies + [x.reply for x in refused] if not r.has_error()}
    failures, uncharged = _named_failures(server_round, [r for r in replies if r.has_error()], sent_to, sent_nodes,
                                          answered, "failed")
    folded.failures.extend(failures)
    folded.uncharged += uncharged
    folded.failed = len(folded.failures)
    for c in oom_confirmations(oom_seen, folded.stats):
        log(WARNING, "round %s: node %s: the kernel's out-of-memory killer killed %s process(es) in its "
            "container since the server last heard from it (oom_kill count %s -> %s): its ClientApp ran out "
            "of memory", server_round, c["node"], c["oom-kills"] - c["oom-kills-before"], c["oom-kills-before"],
            c["oom-kills"])


def evaluate_replies(server_round: int, sent_to: dict[str, int],
                     replies: list[Message]) -> tuple[list[Message], list[dict]]:
    """The evaluation replies the inner strategy may count, and the clients that failed to evaluate,
    by the train round's rules: one node, one vote (`admission.admit`: a second reply of a node
    a reply from a node not sent an evaluate message and one to a message not sent this round are refused,
    logged), each failed client
    named once with its reason escaped to one log line (`failures.round_failures`: an error reply
    charged to its sender, one from a node not sampled or untraceable charged to nobody, a sampled node
    that sent nothing counted as ``NO_REPLY``).

    Parameters
    ----------
    sent_to : dict
        Message id -> destination node id of the round's evaluate messages (empty: not known; then
        no reply is a stranger and no node counts as silent).
    replies : list of Message
        The round's evaluate replies, error replies included.

    Returns
    -------
    (kept, failures)
        ``kept``: the error replies and the admitted replies, in the given order (for the inner
        strategy); ``failures``: one `failures.failed_client` record per failed client.
    """
    sent_nodes = set(sent_to.values()) or None
    errors = [r for r in replies if r.has_error()]
    known = sent_to if "" not in sent_to else None  # ids set once a grid pushed the messages
    admitted, refused = admit([r for r in replies if not r.has_error()], lambda r: r.metadata.src_node_id, sent_nodes,
                              lambda r: r.metadata.reply_to_message_id, known)
    for reply, why in refused:
        log(WARNING, "round %s: evaluation reply from node %s not counted: %s", server_round,
            reply.metadata.src_node_id, why)
    answered = {r.metadata.src_node_id for r in replies if not r.has_error()}
    failures, _ = _named_failures(server_round, errors, sent_to, sent_nodes, answered, "failed to evaluate")
    kept = set(map(id, errors + admitted))
    return [r for r in replies if id(r) in kept], failures


def _named_failures(server_round: int, errors: list[Message], sent_to: dict[str, int], sent_nodes: set[int] | None,
                    answered: set[int], failed: str) -> tuple[list[dict], int]:
    """`failures.round_failures`, each failed client and each uncharged error reply logged as one
    WARNING line (``"round R: client (node N) <failed>: <reason>"``); returns the failure records (charged,
    then silent) and the number of error replies charged to nobody."""
    charged, uncharged, silent = round_failures(errors, sent_to, sent_nodes, answered)
    for reply, f in charged:
        log(WARNING, "round %s: client (node %s) %s: %s", server_round, f["node"], failed,
            failure_reason(reply) + misaddressed_note(reply, sent_to) if f["code"] not in (4, 5, 8) else f["reason"])
    for reply, why in uncharged:
        named = sent_to.get(reply.metadata.reply_to_message_id)
        log(WARNING, "round %s: error reply from node %s (answering %s) not counted: %s; its reason: %s",
            server_round, reply.metadata.src_node_id,
            f"the message sent to node {named}" if named is not None else "a message this round did not send",
            why, failure_reason(reply))
    for f in silent:
        log(WARNING, "round %s: client (node %s) %s: %s", server_round, f["node"], failed, f["reason"])
    return [f for _, f in charged] + silent, len(uncharged)


def failure_reason(reply: Message) -> str:
    """A failed client's error reason for the server's log: the first ``MAX_REASON_CHARS`` (500)
    characters of what the client sent, control characters escaped (``\\n``, ``\\x1b``: one log line,
    no forged lines or terminal escapes), with a hint when it looks like a mis-assembled app."""
    reason = printable(reply.error.reason or "", MAX_REASON_CHARS)
    if "fedcomp.payload" in reason or "clipping_mod expects the keys" in reason:
        reason += (" (hint: compression_mod must be the first mod of the ClientApp, Flower's DP mods go "
                   "in @app.train(mods=[...]), and the server strategy must be wrapped in CompressedStrategy)")
    return reason


__all__ = ["RoundReplies", "evaluate_replies", "failure_reason", "fold_replies", "note_failures"]
