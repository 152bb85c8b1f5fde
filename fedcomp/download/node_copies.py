"""What each node holds of the broadcast, and the server's memory for it: the per-node side of
downstream compression (`fedcomp.download.sender` plans and encodes the messages; this room keeps the
copies those messages are relative to, and forgets within a budget).

Per node the server knows one of: exactly a broadcast version B_u (``node_version[node] = u``), or a
*private* copy (a version plus a per-node catch-up diff, ``private[node]``), or nothing (a new or
forgotten node). A node counts as holding what it was sent only once its reply arrives
(`NodeCopies.commit`); until then the message's plan is *pending*, and a node that was sent
something and did not reply is forgotten at the next round (`NodeCopies.start_round`).

Server memory: one vector of the compressed part per version some node still holds, one per node that
holds a private copy, the broadcast payloads still needed for chains, and (``batchnorm-stats = "auto"``)
each node's copy of the BatchNorm statistics (payload and statistics bytes counted in vectors).
Bounded by the copy budget (`NodeCopies.copy_budget`): past it statistics copies are dropped and
then nodes forgotten (their copy, and the versions and payloads no other node needs), in the order that
forgets fewest nodes (`NodeCopies.evict`); a forgotten node is treated as new, as after a missed
reply. A node whose statistics copy is dropped stays known and is sent the exact statistics next time,
as a new node is. Between a round's sends and its replies only
each node's diff payload is kept (the bytes its message carries), not the copy the node will hold: that
copy is rebuilt when it replies, so a round of N catch-ups costs N payloads rather than N model copies
(``benchmarks/scale.py --only-downstream``).

Source of the policy: Sattler et al., IEEE TNNLS 2019 ("caching": a client that missed rounds gets the
accumulated change); the budget and the eviction order are fedcomp's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import Enum
from typing import Callable

import numpy as np

from fedcomp.statedict import FlatModel

#: Model copies the server keeps for nodes by default (``max_copies = None``) at the least ...
DEFAULT_MAX_COPIES = 8
#: ... or as many as fit in this many bytes (float32 copies of the compressed part), if more: on the
#: LoRA benchmark (2 of 8 clients a round) 8 copies forgot a node every round or two and lost accuracy
#: that remembering every node keeps (``docs/benchmarks/llm.md``). A ResNet-18-sized model (44.6 MB)
#: still gets 8.
COPY_BYTES_FLOOR = 256 * 2**20


class BaseKind(Enum):
    """What a per-node diff is relative to."""

    PRIVATE = "private"  #: the node's own copy (an earlier catch-up)
    START = "start"  #: the start B_1 that a new node builds itself (`NodeCopies.start`)
    VERSION = "version"  #: a broadcast version B_u


@dataclass(frozen=True)
class Base:
    """The vector a diff is relative to: a `BaseKind` and, for `BaseKind.VERSION`, the version u."""

    kind: BaseKind
    version: int = 0


@dataclass(frozen=True)
class Diff:
    """A per-node diff sent this round: its payload and what it is relative to (the node's copy is
    rebuilt from both when it replies, `NodeCopies.commit`)."""

    payload: bytes
    base: Base


class NodeCopies:
    """The versions, per-node copies and chain payloads the server keeps for downstream catch-ups,
    within a copy budget.

    Vectors are the compressed part of the model (every float tensor sent through the codec, flat in
    model order, ``(entries,)``, float32, or float64 for a model with a float64 tensor); a `Base` names
    what a diff is relative to. The sender changes the record only through the methods: `add_version`,
    `set_start`, `send`, `send_stats`, `start_round`, `commit`, `forget`.

    Parameters
    ----------
    max_copies : float or None
        Most copies kept (`copies`), besides the broadcast model and the global one; at least 2
        (checked by `fedcomp.download.sender.Downstream`). None: `copy_budget`'s default.
    """

    def __init__(self, max_copies: float | None = None, pin_start: bool = False) -> None:
        self.max_copies = max_copies
        self.version = 0  # the latest broadcast version
        self.entries = 0  # entries of one vector (set with the first version)
        self.itemsize = 4  # bytes of one entry (8 for a float64 model)
        #: node -> version label of the copy it holds (committed when it replied)
        self.node_version: dict[int, int] = {}
        self.private: dict[int, np.ndarray] = {}  # node -> its copy, if not exactly some B_u
        self.versions: dict[int, np.ndarray] = {}  # u -> B_u (held by some node, or the latest)
        self.payloads: dict[int, bytes] = {}  # u -> broadcast payload B_{u-1} -> B_u
        #: B_1, if new nodes build it themselves (a seeded or compressed start); else None
        self.start: np.ndarray | None = None
        #: keep B_1 and the payloads after it for nodes not seen yet (exact catch-ups), until the budget
        #: has no node left to forget
        self.pin_start = pin_start
        #: node -> (version it will hold, None: exactly that B; else the `Diff` it was sent): the copy
        #: is rebuilt when the node replies (`commit`)
        self.pending: dict[int, tuple[int, Diff | None, bool]] = {}
        #: ``batchnorm-stats = "auto"``: node -> its copy of the BatchNorm statistics (committed when it
        #: replied), and what each node sent something this round will hold
        self.stats: dict[int, FlatModel] = {}
        self.stats_pending: dict[int, FlatModel] = {}
        self._last_seen: dict[int, int] = {}  # node -> receipt counter (least recently replying forgotten first)
        self._receipts = 0

    def add_version(self, vec: np.ndarray, payload: bytes | None = None) -> None:
        """Store the next broadcast version ``vec`` (the first one sets the vectors' size and dtype) and,
        after the first, the ``payload`` that led to it from the previous version."""
        self.version += 1
        if self.version == 1:
            self.entries, self.itemsize = vec.size, vec.dtype.itemsize
        self.versions[self.version] = vec
        if payload is not None:
            self.payloads[self.version] = payload

    def set_start(self, start: np.ndarray | None, first: bool = False) -> None:
        """New nodes build ``start`` (B_1) themselves (None: they get the model dense); ``first``: it also
        replaces the first broadcast version (a compressed start: B_1 is what the start payload decodes to)."""
        self.start = start
        if first:
            self.versions[1] = start

    def send(self, node: int, version: int, diff: Diff | None = None, keep: bool = False) -> None:
        """``node`` was sent a message after which it holds ``version`` exactly (``diff`` None), its base
        plus ``diff``, or (``keep``) the copy it holds; it counts as holding it once it replies (`commit`)."""
        self.pending[node] = (version, diff, keep)

    def send_stats(self, node: int, stats: FlatModel) -> None:
        """``node`` was sent the BatchNorm statistics it will hold once it replies (`commit`)."""
        self.stats_pending[node] = stats

    def stats_sent(self, node: int) -> bool:
        """Whether ``node`` was sent BatchNorm statistics this round (`send_stats`)."""
        return node in self.stats_pending

    def base(self, node: int, base: Base) -> np.ndarray | None:
        """The vector a diff to ``node`` is relative to; None once forgotten."""
        if base.kind is BaseKind.PRIVATE:
            return self.private.get(node)
        if base.kind is BaseKind.START:
            return self.start
        return self.versions.get(base.version)

    def held(self, node: int) -> np.ndarray | None:
        """The vector ``node`` holds (None: unknown, or its version is no longer kept)."""
        found = self.copy_of(node)
        return None if found is None else found[1]

    def copy_of(self, node: int) -> tuple[Base, np.ndarray] | None:
        """``(base, vector)`` of the copy ``node`` holds: its own (`BaseKind.PRIVATE`) or a version
        (nodes holding one version share its `Base`); None: unknown, or its version is no longer kept."""
        if node not in self.node_version:
            return None
        if node in self.private:
            return Base(BaseKind.PRIVATE), self.private[node]
        u = self.node_version[node]
        return (Base(BaseKind.VERSION, u), self.versions[u]) if u in self.versions else None

    # -- a round -----------------------------------------------------------------------------
    def start_round(self) -> None:
        """Before this round's sends: forget the nodes sent something last round that did not reply (their
        copy is unknown), drop what no node needs, and make room for the version this round adds."""
        for node in self.pending:
            self.forget(node)
        self.pending, self.stats_pending = {}, {}
        self.drop_unheld()
        self.evict(self.copy_budget() - 1)

    def commit(self, node: int, rebuild: Callable[[np.ndarray, bytes], np.ndarray],
               verify: Callable[[], bool] | None = None) -> bool:
        """``node`` replied, so it holds what it was sent: ``rebuild(base vector, diff payload)`` gives a
        private copy. A node whose diff's base was forgotten meanwhile is forgotten too (new next time), and
        so is a node whose copy ``verify()`` (called once the record is made, before anything is evicted)
        finds different from the record. Over the budget afterwards: first what nobody needs, then the
        least recently replying nodes. Returns False when the node was forgotten, True otherwise (also when
        nothing was pending for it)."""
        if node not in self.pending:
            return True
        label, diff, keep = self.pending.pop(node)
        base = None if diff is None else self.base(node, diff.base)
        if diff is not None and base is None:
            self.stats_pending.pop(node, None)
            self.forget(node)
            return False
        self.node_version[node] = label
        if node in self.stats_pending:
            self.stats[node] = self.stats_pending.pop(node)
        if diff is not None:
            self.private[node] = rebuild(base, diff.payload)
        elif not keep:
            self.private.pop(node, None)
        if verify is not None and not verify():
            self.forget(node)
            self.drop_unheld()
            return False
        self._receipts += 1
        self._last_seen[node] = self._receipts
        if self.copies() > self.copy_budget():
            self.drop_unheld()
            self.evict(self.copy_budget(), keep=node)
        return True

    # -- the budget ----------------------------------------------------------------------------
    def copy_budget(self) -> float:
        """Most copies kept (`copies`): ``max_copies`` if given, else ``max(8, COPY_BYTES_FLOOR /
        the bytes of one vector)`` (float32 entries; float64 for a model with a float64 tensor)."""
        if self.max_copies is not None:
            return self.max_copies
        return max(DEFAULT_MAX_COPIES, COPY_BYTES_FLOOR / (self.itemsize * max(self.entries, 1)))

    def copies(self) -> float:
        """Stored copies: versions, private copies, payload bytes and the nodes' BatchNorm statistics
        copies (`stats`: their flat float and exact bytes), in float32 vectors of the compressed part."""
        vec_bytes = 4 * max(self.entries, 1)
        extra = sum(len(p) for p in self.payloads.values()) + sum(_nbytes(s) for s in self.stats.values())
        return len(self.versions) + len(self.private) + extra / vec_bytes

    def evict(self, budget: float, keep: int | None = None) -> None:
        """Let go of memory until at most ``budget`` copies are stored, forgetting as few nodes as
        possible: first statistics copies alone (the node stays known and is sent exact statistics next
        time), then nodes whose forgetting alone frees a model copy (a private copy, or the only node
        holding an old version), then nodes that share an old version with others (forgetting one frees
        nothing until the last goes); least recently replying first within each. Under random sampling a
        node that replied long ago is as likely to be sampled next as any other, so fewer forgotten nodes
        means more of them on cheap catch-ups. ``keep`` and the nodes still to reply this round are never
        candidates: their catch-up's base must outlive their reply (committing one reply must never forget
        the copy another node's diff is relative to). A node holding
        exactly the latest version costs nothing beyond its statistics copy."""
        def recency(n: int) -> tuple[int, int]:  # least recently replying first
            return self._last_seen.get(n, -1), n

        while self.copies() > budget:
            others = [n for n in self.node_version if n != keep and n not in self.pending]
            with_stats = [n for n in others if n in self.stats]
            if with_stats:
                del self.stats[min(with_stats, key=recency)]
                continue
            cands = [n for n in others if not self._latest(n)]
            if not cands:
                if self.pin_start:  # let go of the chain from B_1 kept for nodes not seen yet (init + diff)
                    self.pin_start = False
                    self.drop_unheld()
                    continue
                return
            holders = Counter(v for n, v in self.node_version.items() if n not in self.private)
            self.forget(min(cands, key=lambda n: (not self._frees(n, holders), *recency(n))))
            self.drop_unheld()

    def _frees(self, node: int, holders: dict[int, int]) -> bool:
        """Whether forgetting ``node`` alone frees a model copy (``holders``: version -> nodes holding it
        exactly): its private copy, or an old version no other node holds (and not B_1 kept for nodes not
        seen yet)."""
        if node in self.private:
            return True
        version = self.node_version[node]
        pinned = self.start is not None and self.pin_start and version == 1
        return version != self.version and holders.get(version, 0) <= 1 and not pinned

    def _latest(self, node: int) -> bool:
        """``node`` holds exactly the latest version (its model copy costs no memory)."""
        return node not in self.private and self.node_version.get(node) == self.version

    def forget(self, node: int) -> None:
        """Forget what ``node`` holds: it is treated as new."""
        self.node_version.pop(node, None)
        self.private.pop(node, None)
        self._last_seen.pop(node, None)
        self.stats.pop(node, None)

    def drop_unheld(self) -> None:
        """Drop the versions and payloads that no node needs any more (the latest version stays)."""
        held = {v for n, v in self.node_version.items() if n not in self.private}
        if self.start is not None and self.pin_start:
            held.add(1)  # nodes not seen yet start from B_1 (until the budget needs the room)
        for u in [u for u in self.versions if u not in held and u != self.version]:
            del self.versions[u]
        oldest = min(held | {self.version})
        for u in [u for u in self.payloads if u <= oldest]:
            del self.payloads[u]


def _nbytes(model: FlatModel) -> int:
    """Memory of a statistics copy: its flat float vector and its exact (integer) tensors."""
    return model.flat.nbytes + sum(v.nbytes for v in model.exact.values())
