"""Round hooks: the concerns of `CompressedStrategy` that must see a round's messages and each reply
before it vanishes into the running sum.

Flower composes concerns by wrapping strategies (one concern per wrapper), but a wrapper around
`CompressedStrategy` sees only the aggregate, and one inside it only dense replies: a concern that
needs the compressed messages or each reply (what a node holds after its download, a digest it
reports) is a hook the strategy calls at fixed points of a round, in the order the hooks were given:

1. ``on_start(arrays)``: the initial model, before Flower's loop (a hook may replace it).
2. ``on_configure(server_round, arrays, messages, phase)``: the round's train or evaluate messages,
   after the inner strategy made them and sampling kept them (a hook may rewrite their content).
3. ``admit(server_round, replies)``: the refusals among the round's admitted train replies,
   ``[(reply, why)]`` (logged and counted in ``rejected-replies``; the rest go on).
4. ``on_replies(server_round, phase, replies, got, sent)``: the replies once decoded and folded
   (``got``: the round's `replies.RoundReplies`, ``sent``: its `round_history.SentRound`; both None
   for evaluate replies).
5. ``round_metrics()``: the hook's figures for the round's record (since its previous call).
"""

from __future__ import annotations

from typing import Any, Protocol

from flwr.app import ArrayRecord, Message


class RoundHook(Protocol):
    """What `CompressedStrategy` calls on each concern it carries, in a round's order (see the module)."""

    def on_start(self, arrays: ArrayRecord) -> ArrayRecord: ...

    def on_configure(self, server_round: int, arrays: ArrayRecord, messages: list[Message], phase: str) -> None: ...

    def admit(self, server_round: int, replies: list[Message]) -> list[tuple[Message, str]]: ...

    def on_replies(self, server_round: int, phase: str, replies: list[Message], got: Any = None,
                   sent: Any = None) -> None: ...

    def round_metrics(self) -> dict[str, float]: ...


__all__ = ["RoundHook"]
