"""Server checkpoints: written after every round, atomically (temporary file, then rename), in a
plain ``.npz`` of numeric arrays plus a JSON file; read back with ``allow_pickle=False``.

What is saved: the global weights, the round number, the inner strategy's optimizer state where
it has one (FedOpt/FedAdam ``m_t``/``v_t``), the client-level DP accountant (rounds counted and
the epsilon trace), and the metrics of every round so far.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import numpy as np

WEIGHTS = "checkpoint.npz"
META = "checkpoint.json"
_OPT_STATE = ("m_t", "v_t")


def _innermost(strategy: Any) -> Any:
    obj = strategy
    for _ in range(8):
        nxt = getattr(obj, "inner", getattr(obj, "strategy", None))
        if nxt is None:
            return obj
        obj = nxt
    return obj


def save(out_dir: pathlib.Path, server_round: int, weights: dict[str, np.ndarray], strategy: Any,
         rounds: list[dict], extra: dict | None = None) -> None:
    """Write ``checkpoint.npz`` and ``checkpoint.json`` for ``server_round`` (both atomically).

    Parameters
    ----------
    out_dir : pathlib.Path
        The run's results folder.
    server_round : int
        Last completed round.
    weights : dict of str to np.ndarray
        Global weights after that round (model key order is kept in the JSON).
    strategy : CompressedStrategy
        Its inner strategy's ``m_t``/``v_t`` and its ``client_dp`` accountant are saved.
    rounds : list of dict
        The metrics records so far (as in metrics.json).
    extra : dict, optional
        More JSON-serialisable state (e.g. cumulative MB).
    """
    arrays = {f"w/{k}": np.ascontiguousarray(v) for k, v in weights.items()}
    inner = _innermost(strategy)
    for attr in _OPT_STATE:
        state = getattr(inner, attr, None)
        if isinstance(state, dict):
            arrays.update({f"{attr}/{k}": np.ascontiguousarray(v) for k, v in state.items()})
    momentum = getattr(inner, "momentum_vector", None)  # FedAvgM: a list in model order
    if isinstance(momentum, list):
        arrays.update({f"momentum/{i}": np.ascontiguousarray(v) for i, v in enumerate(momentum)})
    meta = {
        "round": server_round, "keys": list(weights), "rounds": rounds, "extra": extra or {},
        "client-dp-rounds": getattr(getattr(strategy, "client_dp", None), "rounds", None),
        "eps-trace": list(getattr(strategy, "_eps_trace", [])),
        "local-dp-rounds": getattr(strategy, "_local_rounds", 0),
    }
    tmp = out_dir / (WEIGHTS + ".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, out_dir / WEIGHTS)
    tmpj = out_dir / (META + ".tmp")
    from .results import _finite_or_none

    tmpj.write_text(json.dumps(_finite_or_none(meta), allow_nan=False))
    os.replace(tmpj, out_dir / META)


def _check_meta(meta: dict, out_dir: pathlib.Path) -> None:
    """Types and ranges of the JSON fields (a hand-edited file must not bypass a privacy budget)."""
    def nonneg_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    problems = []
    if not all(isinstance(r, dict) and nonneg_int(r.get("round")) for r in meta["rounds"]):
        problems.append("'rounds' must be a list of round records")
    elif meta["rounds"] and meta["rounds"][-1]["round"] != meta["round"]:
        problems.append("'round' disagrees with the last round record")
    if not isinstance(meta.get("extra", {}), dict):
        problems.append("'extra' must be an object")
    for key in ("client-dp-rounds", "local-dp-rounds"):
        meta.setdefault(key, 0 if key == "local-dp-rounds" else None)
        if meta[key] is not None and not nonneg_int(meta[key]):
            problems.append(f"'{key}' must be an integer >= 0")
    meta.setdefault("eps-trace", [])
    if not isinstance(meta["eps-trace"], list) or not all(
            e is None or (isinstance(e, (int, float)) and not isinstance(e, bool) and e >= 0) for e in meta["eps-trace"]):
        problems.append("'eps-trace' must be a list of epsilons >= 0")
    if problems:
        raise ValueError(f"{out_dir / META}: " + "; ".join(problems))


def load(out_dir: pathlib.Path, strategy: Any,
         model_shapes: dict[str, tuple] | None = None) -> tuple[int, dict[str, np.ndarray], dict]:
    """Read a checkpoint and restore the strategy's state.

    Returns
    -------
    (round, weights, meta)
        The last completed round, the global weights (model key order), and the JSON metadata.

    Raises
    ------
    FileNotFoundError
        No checkpoint in ``out_dir``.
    ValueError
        An unreadable checkpoint, one that does not fit ``model_shapes``, non-finite weights, or
        optimizer state the inner strategy does not have (naming the file and the problem).
    """
    try:
        meta = json.loads((out_dir / META).read_text())
        with np.load(out_dir / WEIGHTS, allow_pickle=False) as z:
            data = {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - any parse problem is a bad checkpoint
        raise ValueError(f"checkpoint in {out_dir} is unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("round"), int) or isinstance(meta.get("round"), bool) \
            or meta["round"] < 0 or not isinstance(meta.get("keys"), list) or not isinstance(meta.get("rounds"), list):
        raise ValueError(f"{out_dir / META} is not a fedcomp checkpoint (needs an integer 'round', 'keys', 'rounds')")
    try:
        weights = {k: data[f"w/{k}"] for k in meta["keys"]}
    except (KeyError, TypeError) as exc:
        raise ValueError(f"checkpoint in {out_dir} lacks weights for {exc}") from None
    _check_meta(meta, out_dir)
    if model_shapes is not None:
        want = {k: tuple(v) for k, v in model_shapes.items()}
        got = {k: tuple(v.shape) for k, v in weights.items()}
        if want != got:
            raise ValueError(f"checkpoint in {out_dir} does not fit the model: checkpoint {got}, model {want}")
    for k, v in weights.items():
        if not np.issubdtype(v.dtype, np.number) or not np.isfinite(v).all():
            raise ValueError(f"checkpoint in {out_dir}: weights of '{k}' are not finite numbers")
    inner = _innermost(strategy)
    for attr in _OPT_STATE:
        state = {k.split("/", 1)[1]: v for k, v in data.items() if k.startswith(attr + "/")}
        if not state:
            continue
        if not hasattr(inner, attr):
            raise ValueError(f"checkpoint in {out_dir} holds optimizer state '{attr}' that the inner strategy "
                             f"{type(inner).__name__} does not have: resume with the same 'strategy'")
        if {k: v.shape for k, v in state.items()} != {k: v.shape for k, v in weights.items()}:
            raise ValueError(f"checkpoint in {out_dir}: optimizer state '{attr}' does not match the weights")
        setattr(inner, attr, state)
    if meta.get("client-dp-rounds") is not None and getattr(strategy, "client_dp", None) is not None:
        strategy.client_dp.rounds = int(meta["client-dp-rounds"])
    momentum = [data[f"momentum/{i}"] for i in range(len(weights)) if f"momentum/{i}" in data]
    if momentum:
        if not hasattr(inner, "momentum_vector") or len(momentum) != len(weights):
            raise ValueError(f"checkpoint in {out_dir} holds FedAvgM momentum: resume with strategy = 'fedavgm'")
        inner.momentum_vector = momentum
    strategy._eps_trace = [float(e) if e is not None else float("inf") for e in meta["eps-trace"]]
    strategy._local_rounds = meta["local-dp-rounds"]
    return int(meta["round"]), weights, meta
