"""Round hooks: the concerns of `CompressedStrategy` that must see a round's messages and each reply
before it vanishes into the running sum.

Flower composes concerns by wrapping strategies (one concern per wrapper), but a wrapper around
`CompressedStrategy` sees only the aggregate, and one inside it only dense replies: a concern that
needs the compressed messages or each reply (what a node holds after its download, a digest it
reports, EF21's record of each node's estimate, the privacy accounting of the clients' reports) is a
hook the strategy calls at fixed points of a round, in the order the hooks were given:

1. ``on_start(arrays)``: the initial model, before Flower's loop (a hook may replace it).
2. ``configure(server_round, phase, config)``: before the inner strategy makes the round's messages;
   a hook may add entries to ``config`` or return False to send nothing this round (the privacy budget).
3. ``on_messages(server_round, phase, arrays, messages, sent)``: the messages the inner strategy made;
   a hook returns those it keeps (Poisson sampling) and may rewrite their content (the download).
   ``sent``: the round's `round_history.SentRound` for train messages, None for evaluate ones.
4. ``admit(server_round, replies, sent)``: the refusals among the train replies the previous hooks
   admitted, as `Refusal` (a reason: counted in ``rejected-replies``; or a failure record: counted
   as a failed client).
5. ``on_replies(server_round, phase, replies, folded, sent)``: the replies once decoded and folded
   (``folded``: the round's `replies.RoundReplies`, ``sent``: its `round_history.SentRound`; both None
   for evaluate replies).
6. ``on_round_end(server_round, metrics, folded)``: the hook adds its figures to the round's ``metrics``.
7. ``state_dict()`` / ``load_state_dict(state, shapes)``: what a resumed run needs (top-level keys of
   the strategy's checkpoint state).

`RoundHook` does nothing at each point, so a hook implements only the points it needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message


@dataclass(frozen=True)
class Refusal:
    """A train reply a hook refuses before it is decoded.

    Attributes
    ----------
    reply : Message
    reason : str
        Why (logged with the node id).
    failure : dict or None
        None: the reply is counted in ``rejected-replies``. A failure record (``{"node", "code", "error",
        "reason"}``, `failures.failed_client`'s form): the node is counted as a failed client with it.
    """

    reply: Message
    reason: str
    failure: dict | None = None


class RoundHook:
    """What `CompressedStrategy` calls on each concern it carries, in a round's order (see the module);
    every point does nothing here."""

    def on_start(self, arrays: ArrayRecord) -> ArrayRecord:
        return arrays

    def configure(self, server_round: int, phase: str, config: ConfigRecord) -> bool:
        return True

    def on_messages(self, server_round: int, phase: str, arrays: ArrayRecord, messages: list[Message],
                    sent: Any = None) -> list[Message]:
        return messages

    def admit(self, server_round: int, replies: list[Message], sent: Any) -> list[Refusal]:
        return []

    def on_replies(self, server_round: int, phase: str, replies: list[Message], folded: Any = None,
                   sent: Any = None) -> None:
        return None

    def on_round_end(self, server_round: int, metrics: dict[str, float], folded: Any) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any], shapes: dict[str, tuple]) -> None:
        return None


__all__ = ["Refusal", "RoundHook"]
