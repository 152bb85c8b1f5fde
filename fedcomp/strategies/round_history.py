"""What [`CompressedStrategy`][fedcomp.strategies.CompressedStrategy] remembers between its calls: the round
it sent (`SentRound`) and the per-round figures it computed (`RoundHistory`).

Neither is part of a checkpoint: a resumed run rebuilds its round records from ``metrics.json``
(`fedcomp.app.checkpoint`), and a new round starts with a new `SentRound`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flwr.app import Message

from fedcomp.statedict import FlatModel


@dataclass
class SentRound:
    """What the server sent in one round: the global model and how many clients were sampled
    (the divisor of client-level DP: the count, or ``q * N`` under Poisson sampling)."""

    server_round: int
    model: FlatModel
    sampled: float = 0.0
    #: Node ids sent a train message (one node, one vote: replies from others are refused); None: unknown.
    nodes: set[int] | None = None
    #: The train messages as sent (Flower sets their message ids when it pushes them): error replies
    #: name the message they answer, and through it the failed node (`failures`).
    messages: list[Message] = field(default_factory=list)

    def sent_to(self) -> dict[str, int]:
        """Message id -> destination node id of every train message of the round."""
        return {m.metadata.message_id: m.metadata.dst_node_id for m in self.messages}


@dataclass
class RoundHistory:
    """The figures of every round so far, keyed by round number.

    Each attribute is a dict ``{server_round: ...}``; ``CompressedStrategy`` exposes them under
    their public names (``history``, ``client_history``, ...), which the ServerApp's recorder reads.
    """

    #: The wrapper's own round metrics (``upload-bytes``, ``compression-ratio``, ...; ``history``).
    train: dict[int, dict[str, float]] = field(default_factory=dict)
    #: Per-client figures (node, bytes, seconds, link speeds; ``client_history``).
    clients: dict[int, list[dict]] = field(default_factory=dict)
    #: Per-layer means over clients: ``{name: {"update-norm", "compression-error"}}`` (``layer_history``).
    layers: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)
    #: Failed clients: ``[{node, code, error, reason}]`` (`failures`; ``failure_history``).
    failures: dict[int, list[dict]] = field(default_factory=dict)
    #: The inner strategy's aggregate of the clients' evaluate replies (``evaluate_history``).
    evaluate: dict[int, dict[str, float]] = field(default_factory=dict)
    #: Clients that failed federated evaluation (``evaluate_failure_history``).
    evaluate_failures: dict[int, list[dict]] = field(default_factory=dict)
    #: node -> the last ``client-oom-kills`` count it reported (an increase names an OOM kill).
    oom_seen: dict[int, int] = field(default_factory=dict)
    #: node -> the machine it last reported (a node reports it once, in its first reply of a run).
    machines: dict[int, str] = field(default_factory=dict)

    def note_machines(self, clients: list[dict]) -> None:
        """Fill each client's ``machine`` from what its node reported before, and remember new reports."""
        for c in clients:
            if c.get("machine"):
                self.machines[c["node"]] = c["machine"]
            else:
                c["machine"] = self.machines.get(c["node"])

    def record_train(self, server_round: int, metrics: dict[str, float], clients: list[dict],
                     layers: dict[str, dict[str, float]]) -> None:
        """Keep the round's own metrics, per-client figures and per-layer means."""
        self.train[server_round] = metrics
        self.clients[server_round] = clients
        self.layers[server_round] = layers




def _view(name: str) -> property:
    """A read-only view of one of `RoundHistory`'s dicts under its public name."""
    return property(lambda self: getattr(self.rounds, name), doc=f"``RoundHistory.{name}`` (round -> figures).")


class HistoryViews:
    """Mixin of a strategy that keeps a `RoundHistory` in ``rounds``: its dicts under their public names."""

    history = _view("train")
    client_history = _view("clients")
    layer_history = _view("layers")
    failure_history = _view("failures")
    evaluate_history = _view("evaluate")
    evaluate_failure_history = _view("evaluate_failures")


__all__ = ["HistoryViews", "RoundHistory", "SentRound"]
