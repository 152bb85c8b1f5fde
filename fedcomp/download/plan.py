"""The message a node gets this round: the cheapest of the forms its copy allows.

Per destination node (`fedcomp.download.sender.Downstream` gives the round's broadcast payload, the
node's record in `NodeCopies`, the start payload a new node needs first and the bytes of the model
dense), in order of preference:

0. `PlanKind.HELD`: the node holds the latest step already (B_v, or its own copy from a diff sent since
   B_v was made): nothing but the exact tensors; what it lacks reaches it with the next global model.
1. `PlanKind.PAYLOAD`: the node holds B_{v-1} exactly: the broadcast payload.
2. `PlanKind.CHAIN`: the node holds an older B_u exactly: the broadcast payloads u+1..v (exact: B_v).
3. `PlanKind.DIFF`: the node holds some H (an older version or an earlier catch-up): ``C(G - H)`` with
   the downstream codec, per node; the node then holds ``H + decompress(...)``.
4. `PlanKind.INIT`, `PlanKind.INIT_CHAIN`, `PlanKind.INIT_DIFF`: a node that holds nothing builds the
   first broadcast model B_1 itself (a seeded start, or the compressed start payload), then 2 or 3 on
   top of it (nothing on top in the first round).
5. `PlanKind.DENSE`: B_v in every tensor's dtype (no start to build, or whatever is smaller than 2-4).

Between a chain and a diff of equal bytes the chain wins (it is exact); with exact catch-ups a chain is
taken whenever the server still holds its payloads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from fedcomp.download.node_copies import Base, BaseKind, Diff, NodeCopies


class PlanKind(str, Enum):
    """The form of a node's message (its value is what ``Downstream.sent_kind`` reports)."""

    HELD = "held"
    PAYLOAD = "payload"
    CHAIN = "chain"
    DIFF = "diff"
    INIT = "init"
    INIT_CHAIN = "init+chain"
    INIT_DIFF = "init+diff"
    DENSE = "dense"

    @property
    def first_contact(self) -> bool:
        """The node builds the start B_1 first (it held nothing)."""
        return self in (PlanKind.INIT, PlanKind.INIT_CHAIN, PlanKind.INIT_DIFF)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Plan:
    """One node's message this round.

    Attributes
    ----------
    kind : PlanKind
    parts : list of bytes
        The compressed payloads, applied in order (the start payload first for a compressed start).
    base_version : int
        The version the node must hold for the parts to apply (``fedcomp-base-version``; 0: none).
    diff : Diff or None
        For a diff: what the node will hold is its base plus this (None: exactly the latest version).
    """

    kind: PlanKind
    parts: list[bytes] = field(default_factory=list)
    base_version: int = 0
    diff: Diff | None = None


def plan_message(nodes: NodeCopies, node: int, payload: bytes | None, start: list[bytes], dense_cost: int,
                 diff: Callable[[Base, object], bytes], exact_catchup: bool) -> Plan:
    """The cheapest message for ``node`` (see the module).

    Parameters
    ----------
    nodes : NodeCopies
        What the server knows each node holds (read only).
    node : int
        The destination node id.
    payload : bytes or None
        This round's broadcast payload B_{v-1} -> B_v (None in the first round).
    start : list of bytes
        The payloads a node that holds nothing applies to the seeded start first (the compressed start's
        one payload; empty for a seeded start).
    dense_cost : int
        Bytes of the model dense, less what every form carries anyway (the exact tensors).
    diff : callable
        ``diff(base, held_vector) -> bytes``: the compressed ``G - held`` for this node.
    exact_catchup : bool
        Prefer the chain of missed payloads whenever the server holds it.
    """
    v = nodes.version
    known = node in nodes.node_version
    if known:
        label, private = nodes.node_version[node], nodes.private.get(node)
    elif nodes.start is not None:
        label, private = 1, None  # builds B_1 itself from the seed
    else:
        return Plan(PlanKind.DENSE)
    if known and label == v:
        return Plan(PlanKind.HELD, [], label)
    start = [] if known else start  # a compressed start's payload comes first
    if not known and v == 1:
        return Plan(PlanKind.INIT, list(start))  # the start is this round's model
    if payload is not None and known and private is None and label == v - 1:
        return Plan(PlanKind.PAYLOAD, [payload], label)
    start_cost = sum(len(p) for p in start)
    base = (Base(BaseKind.PRIVATE) if private is not None else Base(BaseKind.START) if not known and label == 1
            else Base(BaseKind.VERSION, label))
    held = nodes.base(node, base)
    options: list[tuple[int, int, Plan]] = []
    if private is None and all(u in nodes.payloads for u in range(label + 1, v + 1)):
        chain = [nodes.payloads[u] for u in range(label + 1, v + 1)]
        kind = PlanKind.CHAIN if known else PlanKind.INIT_CHAIN
        options.append((start_cost + sum(len(p) for p in chain), 0, Plan(kind, start + chain, label)))
    if held is not None and not (exact_catchup and options):
        step = diff(base, held)
        kind = PlanKind.DIFF if known else PlanKind.INIT_DIFF
        options.append((start_cost + len(step), 1, Plan(kind, start + [step], label, Diff(step, base))))
    best = min(options, key=lambda o: (o[0], o[1]), default=None)
    if best is None or best[0] >= dense_cost:
        return Plan(PlanKind.DENSE)
    return best[2]


__all__ = ["Plan", "PlanKind", "plan_message"]
