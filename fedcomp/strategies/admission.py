"""One node, one vote: which replies of a round may be counted at all.

A round's aggregate must count each node at most once and only nodes that were sent a message in
that round: a node's reply counted twice doubles its weight (under client-level DP it doubles the
sensitivity the noise was calibrated for, so the guarantee no longer holds), and a reply from a
node nobody asked is not part of the sample. Used by ``CompressedStrategy`` (Message API, node
ids) and ``LegacyCompressedStrategy`` (``ClientProxy.cid``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

import numpy as np

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


def check_max_num_examples(value) -> int:
    """``max_num_examples`` as an int >= 1 (a finite integer); ``ValueError`` naming it otherwise (0
    would reject every reply, inf raised ``OverflowError``, NaN anything)."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))
          and np.isfinite(value) and value >= 1 and float(value).is_integer())
    if not ok:
        raise ValueError(f"max_num_examples must be an integer >= 1 (the largest 'num-examples' a reply may claim), "
                         f"got {value!r}")
    return int(value)


__all__ = ["admit", "check_max_num_examples"]
