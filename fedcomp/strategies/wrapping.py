"""Walking a chain of wrapped strategies: Flower's wrappers (the DP ones) hold the strategy they
wrap in ``.strategy``, fedcomp's (``CompressedStrategy``, ``LegacyCompressedStrategy``,
``RoundOffset``) in ``.inner``.

Every place that needs "the strategy inside" (its record key, weighting key, metric aggregation,
optimizer state for checkpoints, whether a Flower client-side DP wrapper is present, the owner of
a forwarded setting) walks the chain here, one rule for all: ``.strategy`` first, then ``.inner``.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

#: Deepest chain walked (a guard against a wrapper that wraps itself).
MAX_DEPTH = 8
#: Optimizer state of Flower's FedOpt family (FedAdam, FedYogi, FedAdagrad): ``{key: array}``.
OPTIMIZER_STATE = ("m_t", "v_t")
#: Name prefixes of `optimizer_state`'s arrays (``<prefix>/<key or index>``).
OPTIMIZER_PREFIXES = (*OPTIMIZER_STATE, "momentum")


def chain(strategy: Any) -> Iterator[Any]:
    """``strategy``, then every strategy it wraps, outermost first (read from each object's own
    ``__dict__``: a wrapper that forwards attribute reads to its inner strategy must not skip a level)."""
    for _ in range(MAX_DEPTH):
        if strategy is None:
            return
        yield strategy
        own = getattr(strategy, "__dict__", {})
        strategy = own.get("strategy", own.get("inner"))


def innermost(strategy: Any) -> Any:
    """The last strategy of the chain (the one that aggregates: FedAvg, FedAdam, ...)."""
    last = strategy
    for last in chain(strategy):
        pass
    return last


def find_attr(strategy: Any, name: str, default: Any) -> Any:
    """Attribute ``name`` of the outermost strategy in the chain that has it, else ``default``."""
    for s in chain(strategy):
        if hasattr(s, name):
            return getattr(s, name)
    return default


def wraps(strategy: Any, prefix: str) -> bool:
    """Whether some strategy in the chain has a class name starting with ``prefix``."""
    return any(type(s).__name__.startswith(prefix) for s in chain(strategy))


def optimizer_state(strategy: Any) -> dict[str, np.ndarray]:
    """The innermost strategy's server-optimizer state as flat arrays: ``m_t/<key>``, ``v_t/<key>``
    (FedOpt family, dicts keyed by tensor) and ``momentum/<i>`` (FedAvgM, a list in model order);
    empty before the first aggregation and for strategies without one."""
    inner, out = innermost(strategy), {}
    for attr in OPTIMIZER_STATE:
        state = getattr(inner, attr, None)
        if isinstance(state, dict):
            out.update({f"{attr}/{k}": np.array(v, copy=True, order="C") for k, v in state.items()})
    momentum = getattr(inner, "momentum_vector", None)
    if isinstance(momentum, list):
        out.update({f"momentum/{i}": np.array(v, copy=True, order="C") for i, v in enumerate(momentum)})
    return out


def load_optimizer_state(strategy: Any, arrays: dict[str, np.ndarray], shapes: dict[str, tuple]) -> None:
    """Give the innermost strategy the state `optimizer_state` returned.

    Parameters
    ----------
    arrays : dict of str to np.ndarray
        ``m_t/<key>``, ``v_t/<key>``, ``momentum/<i>`` arrays (others are ignored).
    shapes : dict of str to tuple
        The model's tensor shapes in model order (the state must match them).

    Raises
    ------
    ValueError
        State the innermost strategy does not have, or that does not match the model.
    """
    inner = innermost(strategy)
    for attr in OPTIMIZER_STATE:
        state = {k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith(attr + "/")}
        if not state:
            continue
        if not hasattr(inner, attr):
            raise ValueError(f"holds optimizer state '{attr}' that the inner strategy {type(inner).__name__} does not "
                             "have: resume with the same 'strategy'")
        if {k: v.shape for k, v in state.items()} != {k: tuple(s) for k, s in shapes.items()}:
            raise ValueError(f"optimizer state '{attr}' does not match the weights")
        setattr(inner, attr, state)
    momentum = [arrays[f"momentum/{i}"] for i in range(len(shapes)) if f"momentum/{i}" in arrays]
    if momentum:
        if not hasattr(inner, "momentum_vector") or len(momentum) != len(shapes):
            raise ValueError("holds FedAvgM momentum: resume with strategy = 'fedavgm'")
        inner.momentum_vector = momentum
