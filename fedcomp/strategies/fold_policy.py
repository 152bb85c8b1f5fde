"""Which fold a round's replies go into, and whether dense replies are accepted.

The folds themselves are in `aggregate`: clipped (client-level DP), weighted mean (the
FedAvg family, `aggregate.averages_by_weight`) or dense (every other inner strategy).
"""

from __future__ import annotations

from logging import INFO
from typing import Any

import numpy as np
from flwr.common.logger import log

from fedcomp.privacy import ClientLevelDP
from fedcomp.statedict import FlatModel
from fedcomp.strategies.aggregate import ClippedFold, DenseFold, Fold, MeanFold, dense_memory_note, averages_by_weight
from fedcomp.strategies.handover import record_key


class FoldPolicy:
    """Chooses the fold of each round for one inner strategy.

    Parameters
    ----------
    inner : Strategy
        The wrapped Message-API strategy.
    aggregation : {"auto", "dense"}
        "dense": every reply rebuilt as dense weights whatever ``inner`` is.
    """

    def __init__(self, inner: Any, aggregation: str) -> None:
        self.inner, self.aggregation = inner, aggregation
        self._dense_noted = False  # the dense path's memory cost is logged once per run

    def new_fold(self, model: FlatModel, clients: int, client_dp: ClientLevelDP | None,
                 remainders: dict[str, np.ndarray]) -> Fold:
        """The fold of the round: `aggregate.ClippedFold` with ``client_dp``, else
        `aggregate.MeanFold` for a weighted-mean inner strategy, else
        `aggregate.DenseFold` (its memory cost, ``clients`` x model, logged once).
        ``remainders``: the integer rule's carried rounding remainders (updated in place)."""
        if client_dp is not None:
            return ClippedFold(model, client_dp)
        if self.aggregation == "auto" and averages_by_weight(self.inner):
            return MeanFold(model, remainders)
        if not self._dense_noted:
            log(INFO, "%s", dense_memory_note(self.inner, clients, model))
            self._dense_noted = True
        return DenseFold(model, record_key(self.inner), remainders)


def dense_refusal(require_compression: bool, local_dp: Any, ef21: Any, downstream: Any) -> str:
    """Why a dense reply (plain weights, no fedcomp payload) is refused this run ("": accepted);
    ``local_dp``, ``ef21``, ``downstream``: the run's objects of those concerns, or None."""
    if require_compression:
        return "require_compression is set"
    if local_dp is not None:
        return "local DP needs every client to clip and noise its update"
    if ef21 is not None:
        return "EF21's server estimate mirrors the clients' compressed sends"
    if downstream is not None:
        return ("downstream compression: the server cannot tell which model a dense reply is relative to "
                "(the node was sent a compressed copy)")
    return ""


__all__ = ["FoldPolicy", "dense_refusal"]
