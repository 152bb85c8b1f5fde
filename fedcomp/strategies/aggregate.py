"""Aggregation of decoded updates in O(model) memory, whatever the number of clients.

- `RunningSum` folds each decoded reply into one accumulator over the global
  model's flat float vector as soon as it is decoded: sparse parts by scatter-add of their k
  entries (O(k) per client), dense parts segment by segment, in chunks. Nothing per client stays.
- `ExactVotes` does the same for integer/bool tensors by the rules of
  `fedcomp.statedict.integer_mean` and `fedcomp.statedict.bool_majority`.
- The folds say what one accepted reply adds and what the round gives, through one interface
  (`Fold`: ``add`` each reply, ``finish`` once, a `FoldResult`): `MeanFold` (weighted mean, the
  FedAvg family), `ClippedFold` (client-level DP: clip each decoded update, unweighted
  sum), `DenseFold` (every reply rebuilt as dense weights, for any other strategy).
- `in_model_dtypes` turns the aggregate back into the model's dtypes and shapes.
- `averages_by_weight` says which inner strategies aggregate by a weighted mean of the clients'
  weights (Flower's FedAvg family), so that one pre-aggregated reply gives them the same result;
  every other strategy gets every client's dense weights (`dense_memory_note` says what
  that costs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Protocol

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvg, FedAvgM, FedProx, FedYogi

from fedcomp.privacy import ClientLevelDP
from fedcomp.download.layout import is_running_var
from fedcomp.statedict import (
    HALF_DTYPES,
    FlatModel,
    array_to_numpy,
    bool_majority,
    cast_carried,
    cast_checked,
    copy_array,
    exact_weight,
    integer_delta,
    integer_mean,
    numpy_to_array,
    weighted_add,
)
from fedcomp.strategies.decode import DecodedUpdate, TrainReply

#: Entries per chunk of a dense fold (``weight * values`` goes through one float64 scratch of 2 MiB).
CHUNK = 1 << 18

# Strategies whose aggregate_train is FedAvg's weighted mean of the clients' arrays, optionally
# followed by a server optimizer step on that mean (FedAvgM momentum, FedOpt's Adam/Yogi/Adagrad);
# FedProx only changes the clients' objective. Checked in flwr 1.42's sources: each of these
# classes' aggregate_train calls FedAvg.aggregate_train on all replies first.
_WEIGHTED_MEAN = (FedAvg, FedAvgM, FedAdam, FedYogi, FedAdagrad, FedProx)


def averages_by_weight(inner: Any) -> bool:
    """True if ``inner`` aggregates by a weighted mean of the replies' arrays (then one pre-aggregated
    reply with the total weight gives it the same result).

    Exactly the Flower classes in ``_WEIGHTED_MEAN``, or a subclass that overrides neither
    ``aggregate_train`` nor ``train_metrics_aggr_fn`` semantics: a user subclass with its own
    ``aggregate_train`` (robust aggregation, say) or any other strategy (FedMedian, FedTrimmedAvg,
    Krum, Bulyan, Flower's DP wrappers, ...) gets every reply dense.
    """
    cls = type(inner)
    if cls in _WEIGHTED_MEAN:
        return True
    base = next((b for b in cls.__mro__ if b in _WEIGHTED_MEAN), None)
    return base is not None and cls.aggregate_train is base.aggregate_train


def identity_on_one_reply(inner: Any) -> bool:
    """True for exactly Flower's FedAvg and FedProx: their aggregate of one reply is that reply's
    arrays (each multiplied by its weight factor, exactly 1.0), so nothing needs handing over."""
    return type(inner) in (FedAvg, FedProx)


def dense_memory_note(inner: Any, clients: int, model: FlatModel) -> str:
    """The log line of the dense path: why, and what it costs (clients x model bytes)."""
    need = clients * model.dense_bytes
    return (f"fedcomp: {type(inner).__name__} needs every client's weights at once (not a weighted mean): "
            f"decoding {clients} replies dense holds about {need / 2**20:.1f} MiB "
            f"({clients} x {model.dense_bytes / 2**20:.2f} MiB model)")


class RunningSum:
    """``sum_i factor_i * delta_i`` over the float tensors, folded reply by reply.

    One float64 accumulator per float tensor (2x the model's fp32 bytes in all): the factors are the
    raw weights (``num-examples``, up to 1e9), and ``weight * update`` of a finite float32 update can
    overflow float32; float64 cannot, and keeps the sum exact far below fp32 rounding. Per-tensor
    accumulators are released one by one as `mean_record` turns them into weights, so the
    accumulator and the result never coexist in full.

    Parameters
    ----------
    model : FlatModel
        The global model of the round (its flat float layout).
    """

    def __init__(self, model: FlatModel) -> None:
        self.model = model
        self.acc = {k: np.zeros(model.specs[k].numel, dtype=np.float64) for k in model.float_keys}
        self._starts = np.array([model.offsets[k] for k in model.float_keys], dtype=np.int64)
        self.total = 0.0
        self.count = 0
        #: float32 buffer the deferred dense payloads are decoded into, reused for every reply
        #: (``decompress(out=...)``: no fresh tensor-sized array per payload)
        self._decoded: np.ndarray | None = None

    def _decode_buffer(self, update: DecodedUpdate) -> np.ndarray | None:
        need = max((part.numel for part in update.deferred), default=0)
        if need and (self._decoded is None or self._decoded.size < need):
            self._decoded = np.empty(need, dtype=np.float32)
        return self._decoded

    def add(self, update: DecodedUpdate, factor: float, weight: float | None = None) -> None:
        """Fold ``factor * update`` in; ``weight`` (default ``factor``) is added to `total`."""
        keys, offsets = self.model.float_keys, self.model.offsets
        for pos, vals in update.sparse:  # positions are increasing: one slice per tensor
            bounds = np.searchsorted(pos, self._starts)
            ends = np.append(bounds[1:], len(pos))
            for i in np.flatnonzero(ends > bounds):
                k, a, b = keys[i], bounds[i], ends[i]
                self.acc[k][pos[a:b] - offsets[k]] += factor * vals[a:b].astype(np.float64)
        scratch = None
        for start, vals in update.dense_parts(self._decode_buffer(update)):  # each dense part lies in one tensor
            # (deferred ones decoded now, into the reused buffer, and folded before the next is decoded)
            k = self.model.key_at(start) if vals.size else None
            if k is None:
                continue
            acc, o = self.acc[k], start - offsets[k]
            if scratch is None or scratch.size < min(vals.size, CHUNK):
                scratch = np.empty(min(vals.size, CHUNK), dtype=np.float64)
            for i in range(0, vals.size, CHUNK):
                part = vals[i: i + CHUNK]
                tmp = scratch[: part.size]
                np.multiply(part, factor, out=tmp, dtype=np.float64)  # = factor * float64(part), exactly
                acc[o + i: o + i + part.size] += tmp
        self.total += factor if weight is None else weight
        self.count += 1

    def flat(self) -> np.ndarray:
        """The whole sum as one flat float64 vector (model order; for client-level DP's noise)."""
        return np.concatenate([self.acc[k] for k in self.model.float_keys]) if self.acc else np.zeros(0)

    def mean_record(self, exact: dict[str, np.ndarray] | None = None, portable: bool = False):
        """Dense weights ``global + acc / total`` (an ArrayRecord, model dtypes), built tensor by
        tensor; each tensor's accumulator is freed as soon as it is used."""
        scale = 1.0 / self.total if self.total > 0 else 0.0
        return self.model.record(self.acc, exact, check=False, portable=portable, scale=scale)


class ExactVotes:
    """Integer/bool tensors of the replies, aggregated by the documented rules.

    Integers: ``sum_i w_i (v_i - global)`` in exact integer arithmetic (`integer_delta`,
    `weighted_add`; never through float64, so a counter beyond 2**53 moves exactly), then
    `integer_mean` with the rounding remainder carried from round to round in
    ``remainders`` (held by the strategy). Bools: the weight voting True, then
    `bool_majority`. A client that did not send a tensor (local DP) does not vote on it; a
    tensor nobody sent keeps the global value (and its remainder).

    Parameters
    ----------
    model : FlatModel
        The global model of the round.
    remainders : dict of str to np.ndarray, optional
        float64 remainder per integer tensor (entries in [-0.5, 0.5]), read and updated by
        `result` (missing or of another shape: starts at 0). None: no carry.
    """

    def __init__(self, model: FlatModel, remainders: dict[str, np.ndarray] | None = None) -> None:
        self.model = model
        self.sums = {k: (np.zeros(model.specs[k].shape, np.float64) if model.exact[k].dtype == np.bool_
                         else np.zeros(model.specs[k].shape, np.int64)) for k in model.exact_keys}
        self.weights: dict[str, int | Fraction] = dict.fromkeys(model.exact_keys, 0)
        self.remainders = remainders
        self._result: dict[str, np.ndarray] | None = None

    def add(self, exact: dict[str, np.ndarray], weight: float) -> None:
        """Count one client's exact tensors with weight ``weight`` (> 0; ``num-examples``)."""
        w = exact_weight(weight)
        for k, v in exact.items():
            g = self.model.exact[k]
            if g.dtype == np.bool_:
                self.sums[k] += float(w) * v
            else:
                self.sums[k] = weighted_add(self.sums[k], w, integer_delta(v, g))
            self.weights[k] += w
        self._result = None

    def result(self) -> dict[str, np.ndarray]:
        """Every exact tensor's aggregate, in its own dtype and shape. Computed once per round (the
        carried remainders move once); later calls return the same arrays' copies."""
        if self._result is None:
            out = {}
            for k, g in self.model.exact.items():
                w = self.weights[k]
                if w <= 0:
                    out[k] = g.copy()
                elif g.dtype == np.bool_:
                    out[k] = bool_majority(g, self.sums[k], float(w))
                else:
                    rem = None
                    if self.remainders is not None:
                        rem = self.remainders.get(k)
                        if rem is None or rem.shape != g.shape:
                            rem = self.remainders[k] = np.zeros(g.shape, np.float64)
                    out[k] = integer_mean(g, self.sums[k], w, rem)
            self._result = out
        return {k: v.copy() for k, v in self._result.items()}


@dataclass
class FoldResult:
    """What a round's fold gives (`Fold.finish`).

    Attributes
    ----------
    exact : dict of str to np.ndarray
        The integer/bool tensors of the aggregate.
    arrays : ArrayRecord or None
        The folded aggregate as dense weights (the weighted mean, or client-level DP's noisy mean);
        None when the fold keeps every reply instead (`replies`).
    total_weight : float
        The weights folded in (what a pre-aggregated reply carries to the inner strategy).
    replies : list of Message or None
        Every accepted reply as dense weights, for an inner strategy that needs them (`DenseFold`).
    final : bool
        `arrays` is the round's result as it stands: the inner strategy does not aggregate it
        (client-level DP's released mean).
    dp_info : dict
        The round's DP figures (client-level DP; else empty).
    """

    exact: dict[str, np.ndarray]
    arrays: ArrayRecord | None = None
    total_weight: float = 0.0
    replies: list[Message] | None = None
    final: bool = False
    dp_info: dict = field(default_factory=dict)


class Fold(Protocol):
    """What every fold offers the round: ``add`` each accepted reply as it is decoded, then ``finish``
    once; ``weights`` maps each node to the weight its update was folded with, or is None for a fold
    without per-client weights (the downstream correction applies only where it is a dict)."""

    weights: dict[int, float] | None

    def add(self, reply: Message, decoded: TrainReply) -> None: ...

    def finish(self, sampled: float) -> FoldResult | None: ...


class MeanFold:
    """Weighted mean: ``sum_i w_i delta_i`` and the exact tensors' votes, reply by reply.

    Attributes
    ----------
    running : RunningSum
    votes : ExactVotes
    """

    def __init__(self, model: FlatModel, remainders: dict[str, np.ndarray] | None = None) -> None:
        self.running, self.votes = RunningSum(model), ExactVotes(model, remainders)
        #: node id -> the weight its update was folded with (the downstream correction needs both)
        self.weights: dict[int, float] = {}

    def add(self, reply: Message, decoded: TrainReply) -> None:
        """Fold ``decoded`` in with its weight; the reply itself is not kept."""
        self.running.add(decoded.update, decoded.weight)
        self.weights[reply.metadata.src_node_id] = decoded.weight
        self.votes.add(decoded.update.exact, decoded.weight)

    def shift(self, key: str, values: np.ndarray) -> None:
        """Add ``values`` (float64, tensor ``key``'s flat size) to the weighted sum of tensor ``key``: a
        weighted term that is not a reply's update (`fedcomp.download.correction.correct_for_copies`)."""
        self.running.acc[key] += values

    def finish(self, sampled: float) -> FoldResult | None:
        """The weighted mean ``G + sum_i w_i delta_i / sum_i w_i`` as dense weights (the sum's buffers
        freed tensor by tensor), or None when nothing was folded in. ``sampled`` is not used."""
        if not self.running.count:
            return None
        exact = self.votes.result()
        return FoldResult(exact, self.running.mean_record(exact, portable=True), self.running.total)


class ClippedFold:
    """Client-level DP (DP-FedAvg): each decoded update clipped to ``clipping_norm`` and summed
    unweighted; integer/bool tensors are not aggregated (an exact aggregate would be released
    without noise), they keep the global values.

    Parameters
    ----------
    model : FlatModel
    client_dp : ClientLevelDP
        Clipping, noise and the accountant.
    """

    #: no per-client weights: the updates are summed unweighted after clipping
    weights = None

    def __init__(self, model: FlatModel, client_dp: ClientLevelDP) -> None:
        self.model, self.running, self.client_dp = model, RunningSum(model), client_dp
        #: The decoded updates' L2 norms before clipping.
        self.norms: list[float] = []

    def add(self, reply: Message, decoded: TrainReply) -> None:
        """Fold ``clip_factor(||delta||) * delta`` in with weight 1."""
        norm = decoded.update.sq_norm() ** 0.5
        self.norms.append(norm)
        self.running.add(decoded.update, self.client_dp.clip_factor(norm), 1.0)

    def finish(self, sampled: float) -> FoldResult | None:
        """The noisy mean over ``sampled`` clients and the DP figures of the round, the integer/bool
        tensors at their global values; None when nothing was sampled and nothing folded in. A round that
        sampled always runs the mechanism: without accepted replies it releases the noise alone (and
        the accountant counts it)."""
        if not self.running.count and not sampled > 0:
            return None
        agg, dp_info = self.client_dp.finish(self.running.flat(), self.norms, max(sampled, 1e-12))
        return FoldResult(self.model.exact, self.model.record(agg, check=False, portable=True), final=True,
                          dp_info=dp_info)


class DenseFold:
    """Every reply rebuilt as dense weights (in place: its content replaced) for inner strategies
    that need each client's weights; exact tensors still by fedcomp's vote.

    Parameters
    ----------
    model : FlatModel
    record_key : str
        Where the inner strategy reads the weights (its ``arrayrecord_key``).
    remainders : dict, optional
        The integer rule's carried rounding remainders (`ExactVotes`).
    """

    #: no per-client weights in the fold: the inner strategy weighs the replies itself
    weights = None

    def __init__(self, model: FlatModel, record_key: str, remainders: dict[str, np.ndarray] | None = None) -> None:
        self.model, self.record_key = model, record_key
        self.votes = ExactVotes(model, remainders)
        self.replies: list[Message] = []

    def add(self, reply: Message, decoded: TrainReply) -> None:
        """Replace the reply's content by its dense weights and metrics, keep it."""
        self.votes.add(decoded.update.exact, decoded.weight)
        for key in list(reply.content.keys()):
            del reply.content[key]
        update = decoded.update
        reply.content[self.record_key] = self.model.record(update.to_flat(self.model.num_float, self.model.flat.dtype),
                                                           update.exact, check=False, portable=True)
        reply.content["metrics"] = MetricRecord(decoded.metrics)
        self.replies.append(reply)

    def finish(self, sampled: float) -> FoldResult | None:
        """Every accepted reply as dense weights (for the inner strategy) and the exact tensors' votes;
        None without replies. ``sampled`` is not used."""
        return FoldResult(self.votes.result(), replies=self.replies) if self.replies else None


def in_model_dtypes(arrays: ArrayRecord, model: FlatModel, exact: dict[str, np.ndarray],
                    half_remainders: dict[str, np.ndarray] | None = None, var_floor: float = 0.0) -> ArrayRecord:
    """The aggregate with every float tensor in the model's dtype and shape, and the exact
    tensors ``exact`` (copied); a BatchNorm running variance (``*.running_var``) kept at >=
    ``var_floor`` times the round's global one, so >= 0 (a scaled-sign change, ``batchnorm-stats =
    "auto"``, can undershoot a small variance: `fedcomp.download.layout.VAR_FLOOR`).

    Parameters
    ----------
    arrays : ArrayRecord
        The aggregate (half-precision tensors as unrounded float32: `FlatModel.record`'s
        ``portable``).
    model : FlatModel
        The global model of the round (keys, shapes, dtypes).
    exact : dict of str to np.ndarray
        The integer/bool tensors' aggregate.
    half_remainders : dict of str to np.ndarray, optional
        float32 rounding remainder per fp16/bf16 tensor, carried from round to round
        (`fedcomp.statedict.cast_carried`); updated only when every tensor is finite, so a
        refused round leaves it as it was. None: each round rounds on its own.
    var_floor : float
        Fraction of the round's global running variance below which the aggregate's is raised
        (0, the default: only a negative one, to 0).

    Raises
    ------
    ValueError
        A float tensor that is not finite in the model's dtype (naming it).
    """
    out, carried = ArrayRecord(), {}
    for k in model.keys:
        spec = model.specs[k]
        if not spec.is_float:
            out[k] = Array(copy_array(exact[k]))
            continue
        a = arrays[k]
        w = array_to_numpy(a)
        if (spec.dtype not in HALF_DTYPES and w.dtype == np.dtype(spec.dtype) and w.shape == spec.shape
                and not is_running_var(k)):  # a running variance takes the floor below
            if w.size and not np.isfinite(w).all():  # already in the model's dtype: check, keep
                raise ValueError(f"'{k}': aggregate is not finite in the model's dtype {spec.dtype}")
            out[k] = a
            continue
        w = np.asarray(w, dtype=np.float64 if spec.dtype == "float64" else np.float32).reshape(spec.shape)
        if is_running_var(k):  # a lossy change (or the inner strategy) can undershoot
            w = np.maximum(w, model.float_view(k) * var_floor)
        if spec.dtype in HALF_DTYPES and half_remainders is not None:
            w, carried[k] = cast_carried(k, w, spec.dtype, half_remainders.get(k))
        else:
            w = cast_checked(k, w, spec.dtype)
        out[k] = numpy_to_array(w, spec.dtype)
    if half_remainders is not None:
        half_remainders.update(carried)
    return out


__all__ = ["CHUNK", "ClippedFold", "DenseFold", "ExactVotes", "Fold", "FoldResult", "MeanFold", "RunningSum",
           "dense_memory_note", "identity_on_one_reply", "in_model_dtypes", "averages_by_weight"]
