"""Handing a round's fold to the inner strategy, and the aggregate back in the model's dtypes.

Three ways, by what the round's fold gives (`aggregate.Fold.finish`, a `aggregate.FoldResult`):

- a final aggregate (``ClippedFold``, client-level DP): the noisy mean is the aggregate; the inner strategy's
  averaging is replaced; every round that sampled runs the mechanism, an empty one included
  (Poisson sampling may pick nobody): the noise alone is released and the round is counted;
- weighted mean (``MeanFold``): the inner strategy gets ONE pre-aggregated reply (an accepted
  reply's Message, its content replaced by the mean and the total weight), which gives a
  weighted-mean strategy the same result as every reply would; FedAvg's result on one reply is
  that reply, so it is used directly;
- dense (``DenseFold``): the inner strategy gets every reply as dense weights.

Integer/bool tensors come from fedcomp's own rule (``FoldResult.exact``), whatever the inner strategy
does. What the inner strategy reads is asked of it, never guessed: the weighting metric
(Flower's ``weighted_by_key``), the record key (``arrayrecord_key``) and its metric aggregation
(``train_metrics_aggr_fn``), found along the wrapper chain (`wrapping.find_attr`). Names found to
hold one tensor (`fedcomp.statedict.tied.equal_groups`) stay tied: the inner strategy gets them
equal and every name of a group leaves with the same values.
"""

from __future__ import annotations

from collections.abc import Sequence
from logging import ERROR
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from flwr.common.logger import log

from fedcomp.statedict import FlatModel
from fedcomp.statedict.tied import tie_record
from fedcomp.strategies.aggregate import FoldResult, identity_on_one_reply, in_model_dtypes
from fedcomp.strategies.replies import RoundReplies
from fedcomp.strategies.wrapping import find_attr


def weight_key(inner: Any) -> str:
    """The metric ``inner`` weights replies by (Flower's ``weighted_by_key``; default ``num-examples``)."""
    return find_attr(inner, "weighted_by_key", "num-examples")


def record_key(inner: Any) -> str:
    """Where ``inner`` reads the weights in a reply (Flower's ``arrayrecord_key``; default ``arrays``)."""
    return find_attr(inner, "arrayrecord_key", "arrays")


def mean_metrics(inner: Any, metric_contents: list[RecordDict]) -> MetricRecord:
    """What ``inner``'s metric aggregation gives over every reply (its ``train_metrics_aggr_fn``,
    Flower's weighted mean by default; empty when it has none)."""
    fn = find_attr(inner, "train_metrics_aggr_fn", None)
    return MetricRecord(dict(fn(metric_contents, weight_key(inner)))) if callable(fn) else MetricRecord({})


def hand_over(inner: Any, server_round: int, model: FlatModel, folded: RoundReplies, sampled: float,
              half_remainders: dict[str, np.ndarray] | None = None, var_floor: float = 0.0,
              tied: Sequence[Sequence[str]] = ()) -> tuple[ArrayRecord | None, MetricRecord | None, dict]:
    """The round's aggregate in the model's dtypes and shapes, the inner strategy's metrics, and
    the DP figures of the round (client-level DP; else empty).

    Parameters
    ----------
    inner : flwr.serverapp.strategy.Strategy
        The wrapped strategy.
    server_round : int
    model : FlatModel
        The global model of the round.
    folded : RoundReplies
        The round's fold and accepted replies (`replies.fold_replies`).
    sampled : float
        Clients sampled (client-level DP's divisor; ``q * N`` under Poisson sampling).
    half_remainders : dict, optional
        The rounding remainders of the fp16/bf16 tensors, carried from round to round (updated
        in place; `aggregate.in_model_dtypes`). None: no carry.
    var_floor : float
        A BatchNorm running variance falls at most to this fraction of the round's global one
        (`aggregate.in_model_dtypes`; 0: it only stays >= 0).
    tied : sequence of groups of names
        Names that hold one tensor (`fedcomp.statedict.tied.equal_groups`): the inner strategy gets
        them tied (the mean it is handed, or each dense reply) and the aggregate keeps them tied
        (`fedcomp.statedict.tied.tie_record`: each name of a group gets the mean of their values).

    Returns
    -------
    (arrays, metrics, dp_info)
        ``arrays`` None when no reply was accepted (except under client-level DP: a round that
        sampled, ``sampled > 0``, always runs the mechanism, so a round without accepted replies
        releases the noise alone and is counted by the accountant), when the inner strategy returns none, or when
        the aggregate is not finite in the model's dtypes (logged; the global model is kept).
    """
    result = folded.fold.finish(sampled)
    if result is None:
        return None, None, {}
    exact, dp_info, metrics = result.exact, result.dp_info, None
    if result.final:
        arrays = result.arrays
    elif result.replies is None and identity_on_one_reply(inner):
        # FedAvg of one reply is that reply (weight factor w / w = 1.0 exactly): no copies to hand over.
        arrays, metrics = result.arrays, mean_metrics(inner, folded.metric_contents)
    else:
        arrays, metrics = _inner_aggregate(inner, server_round, result, folded, tied)
    if arrays is None:
        return None, metrics, dp_info
    tie_record(arrays, tied)
    try:
        return in_model_dtypes(arrays, model, exact, half_remainders, var_floor), metrics, dp_info
    except ValueError as exc:
        log(ERROR, "round %s: the aggregated model is not finite (%s); keeping the previous global model",
            server_round, exc)
        return None, metrics, dp_info


def _inner_aggregate(inner: Any, server_round: int, result: FoldResult, folded: RoundReplies,
                     tied: Sequence[Sequence[str]] = ()) -> tuple[ArrayRecord | None, MetricRecord | None]:
    """The inner strategy's aggregate of every dense reply, or of one pre-aggregated reply (an
    accepted reply's Message, its content replaced) carrying the total weight; the ``tied`` names
    tied in what it gets."""
    wkey = weight_key(inner)
    means: MetricRecord | None = None
    if result.replies is not None:
        replies = result.replies
    else:
        means = mean_metrics(inner, folded.metric_contents)
        folded.template_reply.content = RecordDict({
            record_key(inner): result.arrays,
            "metrics": MetricRecord({**dict(means), wkey: _as_weight(result.total_weight)})})
        replies = [folded.template_reply]
    for reply in replies if tied else ():
        tie_record(reply.content[record_key(inner)], tied)
    arrays, metrics = inner.aggregate_train(server_round, replies)
    if means is not None and metrics is not None and wkey in means:
        metrics[wkey] = means[wkey]  # what the inner strategy reports over every reply
    for reply in replies:  # drop the dense copies now (memory)
        reply.content = RecordDict()
    return arrays, metrics


def _as_weight(total: float) -> int | float:
    """A total weight as Flower's metrics take it (an int when it is one)."""
    return int(total) if float(total).is_integer() else float(total)


__all__ = ["hand_over", "mean_metrics", "record_key", "weight_key"]
