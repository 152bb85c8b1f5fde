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


def admit(replies: Iterable[T], node_of: Callable[[T], Hashable],
          expected: set | None) -> tuple[list[T], list[tuple[T, str]]]:
    """Split ``replies`` into those that may be counted and those refused, in the given order.

    Parameters
    ----------
    replies : iterable
        The round's replies (Messages or ``(ClientProxy, FitRes)`` pairs).
    node_of : callable
        The node id of a reply.
    expected : set or None
        The node ids sent a message this round; None: not known (no stranger check).

    Returns
    -------
    (admitted, refused)
        ``admitted``: the first reply of each expected node; ``refused``: ``(reply, reason)`` for
        every further reply of a node already seen this round ("duplicate") and every reply from a
        node that was not sent a message ("stranger").
    """
    seen: set = set()
    admitted, refused = [], []
    for r in replies:
        node = node_of(r)
        if expected is not None and node not in expected:
            refused.append((r, "it was not sent a message this round (one node, one vote)"))
        elif node in seen:
            refused.append((r, "a second reply from the same node this round (one node, one vote)"))
        else:
            seen.add(node)
            admitted.append(r)
    return admitted, refused


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
