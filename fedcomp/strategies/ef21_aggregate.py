"""EF21's server side: the running estimate ``h`` of the mean update.

Source: Richtárik, Sokolov, Fatkhullin, "EF21", NeurIPS 2021 (Algorithm 1, lines 6-8 on the
server); the client side is `fedcomp.compression.EF21`.

Clients send ``c_i = C(x_i - h_i)``; the weighted mean of the decoded ``c_i`` is folded into the
server's ``h``, and ``h`` (not the mean of this round's sends) becomes the round's update:
``global <- global + h``. With every client in every round and weights that do not change,
``h`` equals the weighted mean of the clients' ``h_i`` exactly (fp64 sum). With client sampling
or failures it is the EF21 estimate over the clients that replied (the paper's partial
participation variant keeps per-client weights; not done here).

Both sides must hold the same history: a client that lost its ``h_i`` (a SuperNode restarted
without ``client-state-dir``) while ``h`` keeps its share, or whose send the server never folded
(a lost reply, after which the client's ``h_i`` is one send ahead), would diverge silently. Each
reply says the round of the last send its ``h_i`` holds (metric `ESTIMATE_ROUND_METRIC`, 0:
none); the server remembers the round it last folded each node's send (`EF21Aggregate.folded`)
and refuses a reply of a node it has folded before whose estimate is from another round, as a
failed client named ``EF21_STATE_MISMATCH`` (`EF21Aggregate.check_replies`). The server
cannot remove that node's old share from ``h`` (it keeps only the mean), so the node stays refused
until the run is restarted or resumed with the node's state: loud, never silent. A node the server
has never folded must report a fresh ``h_i`` (round 0): one that holds sends (its first reply was lost,
or it comes back under a new node id) is refused the same way. Only after a resume from a checkpoint
that predates the record (`EF21Aggregate.complete` False) is such a node accepted.
"""

from __future__ import annotations

import math
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import Message
from flwr.common.logger import log

from fedcomp.protocol.messages import ESTIMATE_ROUND_METRIC
from fedcomp.strategies.aggregate import RunningSum, averages_by_weight
from fedcomp.protocol.round_hooks import Refusal, RoundHook

#: Failure name (``failures`` in metrics.json) of a reply whose ``h_i`` is not the one the server mirrors.
MISMATCH = "EF21_STATE_MISMATCH"
#: Code of `MISMATCH` in a failure record (Flower's error codes are >= 0, fedcomp's own < 0).
MISMATCH_CODE = -2


class EF21Aggregate:
    """The server's estimate ``h``, one float64 vector per float tensor (model order).

    Attributes
    ----------
    h : dict of str to np.ndarray
        Flat float64 estimate per float tensor; empty before the first round.
    folded : dict of int to int
        Node id -> the server round its last send was folded into ``h``.
    complete : bool
        Whether `folded` covers every send in ``h`` (a fresh run, or a checkpoint holding the
        record); only then is a node never folded held to a fresh ``h_i``.
    """

    def __init__(self) -> None:
        self.h: dict[str, np.ndarray] = {}
        self.folded: dict[int, int] = {}
        self.complete = True

    @classmethod
    def for_strategy(cls, inner: Any, client_dp: Any, aggregation: str) -> EF21Aggregate:
        """A new estimate for ``CompressedStrategy(inner, ...)``, once the settings allow EF21.

        Raises
        ------
        ValueError
            ``inner`` does not aggregate by a weighted mean, ``aggregation`` is not "auto", client-level
            DP is on, or ``inner`` samples a fraction of the clients (``fraction_train < 1``).
        """
        if client_dp is not None or aggregation != "auto" or not averages_by_weight(inner):
            raise ValueError("error_feedback='ef21' needs a weighted-mean inner strategy (FedAvg and its family), "
                             "aggregation='auto' and no client_dp: the server keeps EF21's estimate of the mean update")
        if float(getattr(inner, "fraction_train", 1.0)) < 1.0:
            raise ValueError("error_feedback='ef21' needs every client in every round (fraction_train = 1.0, run "
                             "config 'fraction-train'): the server's single estimate h keeps a departed client's last "
                             "h_i")
        return cls()

    def fold(self, running: RunningSum) -> None:
        """``h <- h + sum / total``, then make ``running`` hold ``h * total`` (so that its mean is ``h``).

        Parameters
        ----------
        running : RunningSum
            This round's weighted sum of decoded sends, with ``total > 0``; changed in place.

        Raises
        ------
        ValueError
            The model's tensors changed size since the last round (the estimate cannot continue).
        """
        if running.total <= 0:
            return
        for k, acc in running.acc.items():
            h = self.h.get(k)
            if h is None:
                h = self.h[k] = np.zeros_like(acc)
            if h.shape != acc.shape:
                raise ValueError(f"EF21: '{k}' has {acc.size} entries, the server's estimate {h.size}")
            h += acc / running.total
            np.multiply(h, running.total, out=acc)

    def check_replies(self, server_round: int,
                      replies: list[Message]) -> tuple[list[Message], list[tuple[Message, dict]]]:
        """Split the round's replies into those kept (error replies untouched, and replies whose ``h_i``
        is the one ``h`` holds) and those refused: a node folded before whose reported
        `ESTIMATE_ROUND_METRIC` is not the round of its last folded send, a node never folded that
        reports an estimate holding sends (while `complete`), or a reply that does not report it (a
        finite integer >= 0).

        Returns
        -------
        (kept, refused)
            ``refused``: ``(reply, failure record)`` with ``{"node", "code": -2, "error":
            "EF21_STATE_MISMATCH", "reason"}`` (logged as a WARNING naming the node and both rounds).
        """
        kept, refused = [], []
        for reply in replies:
            if reply.has_error():  # no update, no estimate: counted by the round's failures
                kept.append(reply)
                continue
            node = int(reply.metadata.src_node_id)
            reported = _reported_round(reply)
            expected = self.folded.get(node)
            if reported is None:
                why = (f"the reply does not say which round its EF21 estimate h_i is from (metric "
                       f"'{ESTIMATE_ROUND_METRIC}'): compression_mod of another fedcomp version?")
            elif expected is not None and reported != expected:
                held = "no estimate (a fresh h_i)" if reported == 0 else f"its estimate h_i as of round {reported}"
                why = (f"the client holds {held}, but the server's estimate h holds its sends up to round {expected} "
                       "(a SuperNode restarted without client-state-dir, or a reply the server never received): "
                       "its update would corrupt h; the node stays refused until the run is restarted or resumed "
                       "with its state")
            elif expected is None and reported != 0 and self.complete:
                why = (f"the client holds its estimate h_i as of round {reported}, but the server's estimate h holds "
                       "no send of this node (its first reply never arrived, or it comes back under a new node id): "
                       "its update would corrupt h; the node stays refused until the run is restarted or resumed "
                       "with its state")
            else:
                kept.append(reply)
                continue
            log(WARNING, "round %s: EF21: reply of node %s refused: %s", server_round, node, why)
            refused.append((reply, {"node": node, "code": MISMATCH_CODE, "error": MISMATCH, "reason": why}))
        return kept, refused

    def round_update(self, server_round: int, running: RunningSum, asked: int, accepted: list[int]) -> int:
        """`fold` the round's sends in and note the round for each ``accepted`` node; return (and
        log) how many of the ``asked`` clients sent no accepted update: their last ``h_i`` stays in ``h``,
        a drift until they return."""
        self.fold(running)
        if running.total > 0:
            self.folded.update({int(n): server_round for n in accepted})
        missing = max(asked - len(accepted), 0)
        if missing:
            log(WARNING, "round %s: EF21: %s sampled client(s) sent no accepted update; their last h_i stays in "
                "the server's estimate h (drift until they return)", server_round, missing)
        return missing

    def state_dict(self) -> dict[str, np.ndarray]:
        """A copy of `h` (for a checkpoint: a resumed run continues with the same estimate)."""
        return {k: np.array(v, copy=True) for k, v in self.h.items()}

    def folded_state(self) -> dict[str, np.ndarray]:
        """`folded` as arrays for a checkpoint: ``{"nodes": uint64 (n,), "rounds": int64 (n,)}``."""
        return {"nodes": np.array(list(self.folded), dtype=np.uint64),
                "rounds": np.array(list(self.folded.values()), dtype=np.int64)}

    def load_state_dict(self, h: dict[str, np.ndarray], shapes: dict[str, tuple],
                        folded: dict[str, np.ndarray] | None = None) -> None:
        """Restore `state_dict` (and `folded_state`); ``shapes``: the model's tensor shapes.

        Raises
        ------
        ValueError
            A tensor the model does not have, or an estimate that is not a finite flat float64
            array with the tensor's number of entries, or node ids and rounds that are not two flat
            uint64 (no node twice) / int64 (>= 0) arrays of one length (the estimate is left unchanged). A state
            without them (an older checkpoint) checks no node until it is folded again.
        """
        folded = folded or {}
        nodes, rounds = folded.get("nodes", np.zeros(0, np.uint64)), folded.get("rounds", np.zeros(0, np.int64))
        if not (isinstance(nodes, np.ndarray) and isinstance(rounds, np.ndarray) and nodes.dtype == np.uint64
                and rounds.dtype == np.int64 and nodes.ndim == rounds.ndim == 1 and nodes.shape == rounds.shape
                and (rounds >= 0).all() and np.unique(nodes).size == nodes.size):
            raise ValueError("EF21's record of folded sends is not node ids (uint64, each once) and rounds "
                             "(int64 >= 0) of one length")
        for k, v in h.items():
            size = int(np.prod(shapes[k])) if k in shapes else None
            if size is None or not isinstance(v, np.ndarray) or v.dtype != np.float64 or v.shape != (size,) \
                    or not np.isfinite(v).all():
                raise ValueError(f"EF21's server estimate of '{k}' is not a finite float64 vector of the tensor's "
                                 f"{size if size is not None else 'unknown (no such tensor)'} entries")
        self.h = {k: np.array(v, copy=True) for k, v in h.items()}
        self.folded = {int(n): int(r) for n, r in zip(nodes.tolist(), rounds.tolist())}
        self.complete = "nodes" in folded or not self.h


class EF21Hook(RoundHook):
    """EF21's server side at the points of a round where `fedcomp.strategies.CompressedStrategy` calls
    its hooks: refuse replies whose ``h_i`` is not the one ``h`` mirrors (admit), fold the round's sends
    into ``h`` so that the round's update is ``h`` (replies), report ``ef21-missing-clients`` (round end),
    and keep ``h`` and its record in checkpoints (``"ef21"``, ``"ef21-folded"``).

    Parameters
    ----------
    estimate : EF21Aggregate
        The server's estimate (`EF21Aggregate.for_strategy` checks the settings allow it).
    """

    def __init__(self, estimate: EF21Aggregate) -> None:
        self.estimate = estimate
        self._missing = 0

    def admit(self, server_round: int, replies: list[Message], sent: Any) -> list[Refusal]:
        """The replies `EF21Aggregate.check_replies` refuses, each a named failure (logged there)."""
        _, refused = self.estimate.check_replies(server_round, replies)
        return [Refusal(reply, record["reason"], record) for reply, record in refused]

    def on_replies(self, server_round: int, phase: str, replies: list[Message], folded: Any = None,
                   sent: Any = None) -> None:
        """Train: ``h`` += the weighted mean of the round's sends; the fold then holds ``h``
        (`EF21Aggregate.round_update`)."""
        if phase != "train":
            return
        asked = len(sent.nodes) if sent.nodes is not None else len(replies) + folded.refused_by_hooks
        self._missing = self.estimate.round_update(server_round, folded.fold.running, asked,
                                                   [st["node"] for st in folded.stats])

    def on_round_end(self, server_round: int, metrics: dict[str, float], folded: Any) -> None:
        """``ef21-missing-clients``: sampled clients whose send is not in this round's ``h``."""
        metrics["ef21-missing-clients"] = float(self._missing)

    def state_dict(self) -> dict[str, Any]:
        """``{"ef21": {tensor: flat float64 h}, "ef21-folded": {"nodes", "rounds"}}``."""
        return {"ef21": self.estimate.state_dict(), "ef21-folded": self.estimate.folded_state()}

    def load_state_dict(self, state: dict[str, Any], shapes: dict[str, tuple]) -> None:
        """Restore `state_dict` (`EF21Aggregate.load_state_dict`)."""
        self.estimate.load_state_dict(state.get("ef21", {}), shapes, state.get("ef21-folded"))


def _reported_round(reply: Message) -> int | None:
    """The reply's `ESTIMATE_ROUND_METRIC` as an int >= 0, None if absent or not one."""
    for rec in reply.content.metric_records.values():
        v = rec.get(ESTIMATE_ROUND_METRIC)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 \
                and float(v).is_integer():
            return int(v)
    return None


__all__ = ["MISMATCH", "MISMATCH_CODE", "EF21Aggregate", "EF21Hook"]
