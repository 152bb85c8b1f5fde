"""The compressed download as a round hook of `fedcomp.strategies.CompressedStrategy`
(`fedcomp.protocol.round_hooks.RoundHook`): everything the strategy does for the download, in a
round's order.

- start: the initial model new nodes build (`Downstream.start_model`: seeded where the first-contact
  policy says), so that round 0's evaluation and round 1 see it;
- configure: each train and evaluate message rewritten into the cheapest form for its node
  (`Downstream.prepare`);
- admit: a train reply to a compressed download must report its node's copy (`reported_copy`); a
  reply without it comes from an older fedcomp and is refused, naming the upgrade;
- replies: each replying node holds what it was sent, if its digest matches the server's record
  (else it is forgotten and re-synchronised by a first contact); its download is charged at the
  bytes the server sent; with a correction, each update is counted from the global model
  (`Downstream.note_replies`);
- figures: ``copy-resyncs``, the nodes re-synchronised since the previous round's figures.

`DenseDownload` is the hook of a run without a compressed download: each reply's ``download-bytes`` are
the bytes the server sent its node.
"""

from __future__ import annotations

from logging import WARNING
from typing import Any

from flwr.app import ArrayRecord, Message
from flwr.common.logger import log

from fedcomp.download.sender import NO_COPY_REPORT, Downstream, reported_copy
from fedcomp.protocol.round_hooks import Refusal, RoundHook


class DownloadHook(RoundHook):
    """`Downstream` at the points of a round where `CompressedStrategy` calls its hooks.

    Parameters
    ----------
    downstream : Downstream
        The download's state (broadcast model, what each node holds).
    correct : bool
        Whether the round's fold takes the downstream correction (False under EF21, whose fold holds
        the clients' innovations, not their updates).
    """

    def __init__(self, downstream: Downstream, correct: bool = True) -> None:
        self.downstream, self.correct = downstream, correct
        self._resyncs = 0  # nodes re-synchronised since the last `round_metrics`

    def on_start(self, arrays: ArrayRecord) -> ArrayRecord:
        """The initial model as new nodes will build it (`Downstream.start_model`)."""
        return self.downstream.start_model(arrays)

    def on_messages(self, server_round: int, phase: str, arrays: ArrayRecord, messages: list[Message],
                    sent: Any = None) -> list[Message]:
        """The round's ``messages``, rewritten into the download's forms (`Downstream.prepare`)."""
        if messages:
            self.downstream.prepare(server_round, arrays, messages, phase=phase)
        return messages

    def admit(self, server_round: int, replies: list[Message], sent: Any) -> list[Refusal]:
        """Refuse the train replies of nodes sent a compressed download that report no copy digest."""
        pending = self.downstream.nodes.pending
        return [Refusal(r, NO_COPY_REPORT) for r in replies
                if r.metadata.src_node_id in pending and reported_copy(r) is None]

    def on_replies(self, server_round: int, phase: str, replies: list[Message], folded: Any = None,
                   sent: Any = None) -> None:
        """Each replying node holds what it was sent, if its digest says so. Train: its
        ``download-bytes`` are the bytes the server sent it and, with a correction, its update is counted
        from the global model (`Downstream.note_replies`). Evaluate: a node that reports no digest is
        forgotten (logged)."""
        if phase == "train":
            digests = {r.metadata.src_node_id: digest for r in replies
                       if not r.has_error() and (digest := reported_copy(r)) is not None}
            self.downstream.note_replies(folded.stats, folded.fold if self.correct else None, sent.model, digests)
        else:
            for reply in replies:
                node = reply.metadata.src_node_id
                if reply.has_error() or node not in self.downstream.nodes.pending:
                    continue  # an error, or a node sent nothing this phase (a stray or repeated reply)
                digest = reported_copy(reply)
                if digest is None:
                    log(WARNING, "round %s: node %s evaluated, but %s", server_round, node, NO_COPY_REPORT)
                self.downstream.received(node, b"" if digest is None else digest)
        self._note_resyncs(server_round)

    def _note_resyncs(self, server_round: int) -> None:
        """Log the nodes whose copy differed from the server's record and count them."""
        resynced = self.downstream.resynced
        if resynced:
            log(WARNING, "round %s: the model copy of node(s) %s differs from the server's record of it; they get "
                "a first contact next time (re-synchronised)", server_round, sorted(resynced))
            self._resyncs += len(resynced)
            resynced.clear()

    def on_round_end(self, server_round: int, metrics: dict[str, float], folded: Any) -> None:
        """``copy-resyncs``: nodes re-synchronised since the previous round's figures (the previous
        round's evaluation included)."""
        metrics["copy-resyncs"], self._resyncs = float(self._resyncs), 0


class DenseDownload(RoundHook):
    """The download of a run that sends the model dense: each train reply's ``download-bytes`` is the
    bytes of the arrays the server sent its node, not what the node reports."""

    def on_replies(self, server_round: int, phase: str, replies: list[Message], folded: Any = None,
                   sent: Any = None) -> None:
        if phase != "train":
            return
        sent_bytes = {m.metadata.dst_node_id: sum(len(a.data) for r in m.content.array_records.values()
                                                  for a in r.values()) for m in sent.messages}
        for stat in folded.stats:
            reported = max(stat["download-bytes"], 0.0)  # a reply without a sent message (tests): its word
            stat["download-bytes"] = float(sent_bytes.get(stat["node"], reported))


__all__ = ["DenseDownload", "DownloadHook"]
