"""The downstream correction: each client's update counted from the global model, not from its copy.

With a compressed download a client trains from its copy ``H_i`` of the global model ``G`` (the
broadcast version, or its own catch-up copy), and ``G - H_i`` is what the server has not sent it yet
(server-side error feedback keeps it for later messages). Local training re-learns much of that
difference from the client's data, so the update ``delta_i`` carries part of ``G - H_i`` a second
time, and adding it to ``G``, which already holds it, overshoots. The server knows ``H_i`` exactly
(it records what every client holds, :mod:`.node_copies`), so it folds

    delta_i - c * (G - H_i)

with the client's weight instead of ``delta_i``. ``c = 1`` is FedAvg of the models the clients
computed (``H_i + delta_i``): what was not sent and not re-learned is dropped; ``c = 0`` is the
plain bidirectional error feedback of Sattler et al. (IEEE TNNLS 2019). Measured (``benchmarks/both_ways.py``, docs/benchmarks/both-ways.md): with STC downward and AdamW
on the clients (the Transformer from scratch, every client every round) ``c = 1`` is 3 points better
at round 20; with SGD on the clients (the default CNN federation) it is 1.6 points worse, and with
``sign`` downward under 2-of-8 sampling (the LoRA preset) it keeps less of the gain. So the
strategy's default is 0, and fedcomp's app turns it on for AdamW with a sparse downstream codec
(run config ``downstream-correction = "auto"``, :func:`fedcomp.config.downstream.resolve_correction`).

Applies where the round is a weighted mean of the updates (:class:`.aggregate.MeanFold`); not under
client-level DP (clipped sums), EF21 (innovations, not updates), nor with an inner strategy that
needs each client's dense weights.
"""

from __future__ import annotations

import numpy as np

from fedcomp.protocol.broadcast import gather
from fedcomp.statedict import FlatModel

def check_correction(value: float) -> float:
    """``value`` as the correction ``c``, a float in [0, 1].

    Raises
    ------
    ValueError
        ``value`` is not a number in [0, 1] (a bool, NaN or a string included).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"downstream correction must be a number in [0, 1], got {value!r}")
    return float(value)


def correct_for_copies(fold, keys: list[str], sent: FlatModel, held, c: float) -> int:
    """Fold ``c * w_i * (H_i - G)`` into ``fold``'s weighted sum for every client of the round whose
    copy the server knows.

    Parameters
    ----------
    fold : MeanFold
        The round's fold (``weights``: node -> weight; ``running``: the weighted sum). Any other
        fold is left as it is.
    keys : list of str
        The compressed part's tensors (what ``held`` returns, concatenated in model order).
    sent : FlatModel
        The global model ``G`` the round was sent from.
    held : callable
        ``held(node) -> (sum numel,)`` float vector the node trained from, or None (unknown: that
        client's update is folded as it is).
    c : float
        In [0, 1]; 0 changes nothing.

    Returns
    -------
    int
        The number of clients whose update was corrected.
    """
    weights = getattr(fold, "weights", None)
    if not c or not isinstance(weights, dict) or not weights:
        return 0
    g = gather(sent, keys).astype(np.float64)
    done = 0
    for node, w in weights.items():
        h = held(node)
        if h is None:
            continue
        fold.running.add_vector(keys, h.astype(np.float64) - g, c * w)
        done += 1
    return done


__all__ = ["check_correction", "correct_for_copies"]
