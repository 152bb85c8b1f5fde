"""One node, one vote: which replies of a round may be counted at all.

A round's aggregate must count each node at most once and only nodes that were sent a message in
that round: a node's reply counted twice doubles its weight (under client-level DP it doubles the
sensitivity the noise was calibrated for, so the guarantee no longer holds), and a reply from a
node nobody asked is not part of the sample. Used by ``CompressedStrategy`` (Message API, node
ids) and ``LegacyCompressedStrategy`` (``ClientProxy.cid``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from logging import WARNING
from typing import Any, TypeVar

import numpy as np
from flwr.app import Message
from flwr.common.logger import log

from fedcomp.compression import PayloadError
from fedcomp.protocol.round_hooks import Refusal, RoundHook

T = TypeVar("T")


def admit(replies: Iterable[T], node_of: Callable[[T], Hashable], expected: set | None,
          answers: Callable[[T], str] | None = None,
          sent_to: dict[str, Hashable] | None = None) -> tuple[list[T], list[tuple[T, str]]]:
    """Split ``replies`` into those that may be counted and those refused, in the given order.

    Parameters
    ----------
    replies : iterable
        The round's replies (Messages or ``(ClientProxy, FitRes)`` pairs).
    node_of : callable
        The node id of a reply.
    expected : set or None
        The node ids sent a message this round; None: not known (no stranger check).
    answers : callable, optional
        The id of the message a reply answers (a Message's ``metadata.reply_to_message_id``).
    sent_to : dict, optional
        Message id -> destination node of every message sent this round; None or empty: not known
        (no check of what a reply answers).

    Returns
    -------
    (admitted, refused)
        ``admitted``: the first reply of each expected node that answers the message this round sent
        it; ``refused``: ``(reply, reason)`` for every reply from a node that was not sent a message
        ("stranger"), every reply that answers no message sent this round (a stale reply from an
        earlier round, or a forged one) or the message sent to another node, and every further reply
        of a node already seen this round ("duplicate"). A refused reply does not use up its node's
        vote: the node's reply to this round's message is admitted after it.
    """
    seen: set = set()
    admitted, refused = [], []
    for r in replies:
        node = node_of(r)
        named = (answers(r), sent_to.get(answers(r))) if answers is not None and sent_to else None
        if expected is not None and node not in expected:
            refused.append((r, "it was not sent a message this round (one node, one vote)"))
        elif named is not None and named[1] is None:
            refused.append((r, (f"it answers message {printable_id(named[0])}, which this round did not send "
                                "(a stale reply from an earlier round, or forged)")))
        elif named is not None and named[1] != node:
            refused.append((r, f"it answers the message sent to node {named[1]}, not the one sent to node {node}"))
        elif node in seen:
            refused.append((r, "a second reply from the same node this round (one node, one vote)"))
        else:
            seen.add(node)
            admitted.append(r)
    return admitted, refused


def printable_id(message_id: object, limit: int = 80) -> str:
    """A message id as it goes in a log line: ``repr`` of its first ``limit`` characters (untrusted
    text: no newline or escape reaches the console)."""
    return ascii(str(message_id)[:limit])


def check_weight(n: object, key: str, max_weight: int) -> float:
    """A reply's claimed weight ``n`` (its ``key``, e.g. ``num-examples``) as a float, if it is an integer
    in [1, ``max_weight``]: one client cannot dictate or poison a weighted mean.

    Raises
    ------
    PayloadError
        ``n`` is a bool, not a finite number, not an integer, below 1 or above ``max_weight``.
    """
    if (isinstance(n, bool) or not isinstance(n, (int, float, np.integer, np.floating)) or not np.isfinite(n)
            or n < 1 or n != int(n) or n > max_weight):
        raise PayloadError(f"'{key}' must be an integer in [1, {max_weight}], got {n!r}")
    return float(n)


def check_max_num_examples(value) -> int:
    """``max_num_examples`` as an int >= 1 (a finite integer); ``ValueError`` naming it otherwise (0
    would reject every reply, inf raised ``OverflowError``, NaN anything)."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))
          and np.isfinite(value) and value >= 1 and float(value).is_integer())
    if not ok:
        raise ValueError(f"max_num_examples must be an integer >= 1 (the largest 'num-examples' a reply may claim), "
                         f"got {value!r}")
    return int(value)


class Admission(RoundHook):
    """Which train replies `fedcomp.strategies.CompressedStrategy` counts at all: one node, one vote
    (`admit`), the largest weight a reply may claim, and whether plain dense replies are accepted.

    Parameters
    ----------
    max_num_examples : int
        Largest ``num-examples`` (the inner strategy's weighting key) a reply may claim; replies with a
        non-integer, non-finite, < 1 or larger weight are refused, so that one client cannot dictate or
        poison the weighted mean. Default 10**9.
    require_compression : bool
        Refuse dense replies (plain weights from a client without ``compression_mod``). Default False: a
        mixed fleet works, each dense reply validated like a payload and counted under
        ``upload-bytes-dense`` (dense replies are refused anyway under local DP, EF21 and a compressed
        download: `fold_policy.dense_refusal`).

    Raises
    ------
    ValueError
        ``max_num_examples`` not an integer >= 1, ``require_compression`` not a bool.
    """

    def __init__(self, max_num_examples: int = 10**9, require_compression: bool = False) -> None:
        self.max_num_examples = check_max_num_examples(max_num_examples)
        if not isinstance(require_compression, bool):
            raise ValueError(f"require_compression must be True or False, got {require_compression!r}")
        self.require_compression = require_compression

    def admit(self, server_round: int, replies: list[Message], sent: Any) -> list[Refusal]:
        """Refuse strangers, duplicates and replies to a message this round did not send (`admit`);
        what each reply answers is checked once the round's messages have their ids (a grid pushed them)."""
        pushed = sent.messages and all(m.metadata.message_id for m in sent.messages)
        _, refused = admit(replies, lambda r: r.metadata.src_node_id, sent.nodes,
                           lambda r: r.metadata.reply_to_message_id, sent.sent_to() if pushed else None)
        return [Refusal(reply, why) for reply, why in refused]


def admit_replies(hooks: Iterable[RoundHook], server_round: int, replies: list[Message],
                  sent: Any) -> tuple[list[Message], list[Refusal]]:
    """Each hook's refusals among the replies the hooks before it admitted (logged, unless a named
    failure), in a fixed order (by node id): float sums, and so runs, do not depend on arrival order.
    Returns (error replies + admitted replies, refusals).

    Error replies carry no update (no vote) and count as failed clients with their reason: Flower
    answers a task it lost (e.g. a ClientApp the OOM killer took) from the SuperLink's node id, which
    the stranger check would misreport as a reply "not sent a message this round".
    """
    errors = [r for r in replies if r.has_error()]
    replies = sorted((r for r in replies if not r.has_error()), key=lambda r: r.metadata.src_node_id)
    refused: list[Refusal] = []
    for hook in hooks:
        out = hook.admit(server_round, replies, sent)
        refused += out
        replies = [r for r in replies if not any(r is x.reply for x in out)]
    for refusal in refused:
        if refusal.failure is None:
            log(WARNING, "round %s: rejected reply from node %s: %s", server_round,
                refusal.reply.metadata.src_node_id, refusal.reason)
    return errors + replies, refused


__all__ = ["Admission", "admit", "admit_replies", "check_max_num_examples", "check_weight"]
