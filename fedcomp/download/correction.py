"""The downstream correction: each client's update counted from the global model, not from its copy.

With a compressed download a client trains from its copy ``H_i`` of the global model ``G`` (the
broadcast version, or its own catch-up copy), and ``G - H_i`` is what the server has not sent it yet
(server-side error feedback keeps it for later messages). Local training re-learns much of that
difference from the client's data, so the update ``delta_i`` carries part of ``G - H_i`` a second
time, and adding it to ``G``, which already holds it, overshoots. The server knows ``H_i`` exactly
(it records what every client holds, `node_copies`), so it folds

    delta_i - c * (G - H_i)

with the client's weight instead of ``delta_i``. ``c = 1`` is FedAvg of the models the clients
computed (``H_i + delta_i``): what was not sent and not re-learned is dropped; ``c = 0`` is the
plain bidirectional error feedback of Sattler et al. (IEEE TNNLS 2019).

Measured (``benchmarks/both_ways.py``, docs/benchmarks/both-ways.md): with STC downward and AdamW on
the clients (the Transformer from scratch, every client every round) ``c = 1`` is 2.2 points better at
round 20 (median of 3 seeds); with SGD on the clients (the default CNN federation) it is 1.4 points
worse, and with ``sign`` downward under 2-of-8 sampling (the LoRA preset) it keeps less of the gain.
So the strategy's default is 0, and fedcomp's app turns it on for AdamW with a sparse downstream codec
(run config ``downstream-correction = "auto"``, `fedcomp.app.resolve.resolve_correction`).

Applies where the round is a weighted mean of the updates (`aggregate.MeanFold`); not under
client-level DP (clipped sums), EF21 (innovations, not updates), nor with an inner strategy that
needs each client's dense weights.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

import numpy as np

from fedcomp.statedict import FlatModel


def check_correction(value: float) -> float:
    """``value`` as the correction ``c``, a float in [0, 1].

    Raises
    ------
    ValueError
        ``value`` is not a real number in [0, 1] (a bool, NaN or a string included).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"downstream correction must be a number in [0, 1], got {value!r}")
    return float(value)


def correction_refusal(c: float, downstream: bool, client_dp: bool, ef21: bool, weighted_mean: bool,
                       dense_aggregation: bool = False) -> str:
    """Why the downstream correction ``c`` cannot apply to this strategy ("": it can, or c is 0): it
    corrects the clients' copies of a compressed download, in a weighted mean of their updates."""
    if not c:
        return ""
    if not downstream:
        return "it corrects for a compressed download, and the download is dense (downstream none)"
    if client_dp:
        return "client-level DP clips and noises each update as it came (the correction is not applied there)"
    if ef21:
        return "EF21 folds the clients' innovations, not their updates"
    if dense_aggregation:
        return "aggregation = 'dense' rebuilds every client's weights, where the correction is not applied"
    if not weighted_mean:
        return ("the inner strategy needs every client's weights (not a weighted mean of the updates), where the "
                "correction is not applied")
    return ""


def correct_for_copies(fold, keys: list[str], sent: FlatModel, copies: Iterable[tuple[np.ndarray, float]],
                       c: float) -> int:
    """Fold ``c * w * (H - G)`` into ``fold``'s weighted sum for every ``(H, w)`` of ``copies``,
    tensor by tensor (one float64 scratch buffer of the largest tensor, no model-sized temporaries).

    Parameters
    ----------
    fold : Fold
        The round's fold (`fedcomp.strategies.aggregate.Fold`): with per-client ``weights`` (a dict), the
        terms go into its weighted sum through ``fold.shift(key, values)``; a fold without them
        (client-level DP's clipped sum, dense replies) is left as it is.
    keys : list of str
        The compressed part's tensors (each ``H`` is their values concatenated in model order);
        BatchNorm's running statistics are not among them by default (they travel apart,
        ``batchnorm-stats``) and are folded as they came.
    sent : FlatModel
        The global model ``G`` the round was sent from.
    copies : iterable of (np.ndarray, float)
        A copy the round's clients trained from, ``(sum numel,)`` float, and the total weight of the
        clients that held it (`fedcomp.download.sender.Downstream.note_replies` groups the clients on
        one broadcast version, so a round where every client holds B costs one pass, not one per client).
    c : float
        In [0, 1]; 0 changes nothing.

    Returns
    -------
    int
        The number of copies folded in.
    """
    if not c or not isinstance(getattr(fold, "weights", None), dict):
        return 0
    sizes = [sent.specs[k].numel for k in keys]
    scratch = np.empty(max(sizes, default=0), dtype=np.float64)
    done = 0
    for h, w in copies:
        off = 0
        for k, n in zip(keys, sizes):
            buf = scratch[:n]
            np.subtract(h[off: off + n], sent.float_view(k).ravel(), out=buf, dtype=np.float64)
            buf *= c * w
            fold.shift(k, buf)
            off += n
        done += 1
    return done


__all__ = ["check_correction", "correct_for_copies", "correction_refusal"]
