"""EF21's server side: the running estimate ``h`` of the mean update.

Source: Richtárik, Sokolov, Fatkhullin, "EF21", NeurIPS 2021 (Algorithm 1, lines 6-8 on the
server); the client side is :class:`fedcomp.compression.EF21`.

Clients send ``c_i = C(x_i - h_i)``; the weighted mean of the decoded ``c_i`` is folded into the
server's ``h``, and ``h`` (not the mean of this round's sends) becomes the round's update:
``global <- global + h``. With every client in every round and weights that do not change,
``h`` equals the weighted mean of the clients' ``h_i`` exactly (fp64 sum). With client sampling
or failures it is the EF21 estimate over the clients that replied (the paper's partial
participation variant keeps per-client weights; not done here).
"""

from __future__ import annotations

from logging import WARNING
from typing import Any

import numpy as np
from flwr.common.logger import log

from .aggregate import RunningSum, streams


class EF21Aggregate:
    """The server's estimate ``h``, one float64 vector per float tensor (model order).

    Attributes
    ----------
    h : dict of str to np.ndarray
        Flat float64 estimate per float tensor; empty before the first round.
    """

    def __init__(self) -> None:
        self.h: dict[str, np.ndarray] = {}

    @classmethod
    def for_strategy(cls, inner: Any, client_dp: Any, aggregation: str) -> EF21Aggregate:
        """A new estimate for ``CompressedStrategy(inner, ...)``, once the settings allow EF21.

        Raises
        ------
        ValueError
            ``inner`` does not aggregate by a weighted mean, ``aggregation`` is not "auto", client-level
            DP is on, or ``inner`` samples a fraction of the clients (``fraction_train < 1``).
        """
        if client_dp is not None or aggregation != "auto" or not streams(inner):
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

    def round_update(self, server_round: int, running: RunningSum, asked: int, accepted: int) -> int:
        """:meth:`fold` the round's sends in; return (and log) how many of the ``asked`` clients sent
        no accepted update: their last ``h_i`` stays in ``h``, a drift until they return."""
        self.fold(running)
        missing = max(asked - accepted, 0)
        if missing:
            log(WARNING, "round %s: EF21: %s sampled client(s) sent no accepted update; their last h_i stays in "
                "the server's estimate h (drift until they return)", server_round, missing)
        return missing

    def state_dict(self) -> dict[str, np.ndarray]:
        """A copy of :attr:`h` (for a checkpoint: a resumed run continues with the same estimate)."""
        return {k: np.array(v, copy=True) for k, v in self.h.items()}

    def load_state_dict(self, h: dict[str, np.ndarray], shapes: dict[str, tuple]) -> None:
        """Restore :meth:`state_dict`; ``shapes``: the model's tensor shapes.

        Raises
        ------
        ValueError
            A tensor the model does not have, or an estimate that is not a finite flat float64
            array with the tensor's number of entries (the estimate is left unchanged).
        """
        for k, v in h.items():
            size = int(np.prod(shapes[k])) if k in shapes else None
            if size is None or not isinstance(v, np.ndarray) or v.dtype != np.float64 or v.shape != (size,) \
                    or not np.isfinite(v).all():
                raise ValueError(f"EF21's server estimate of '{k}' is not a finite float64 vector of the tensor's "
                                 f"{size if size is not None else 'unknown (no such tensor)'} entries")
        self.h = {k: np.array(v, copy=True) for k, v in h.items()}


__all__ = ["EF21Aggregate"]
