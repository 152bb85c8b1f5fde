"""Server checkpoints: written after every round as one atomic unit, read back with
``allow_pickle=False``.

The unit is a pair: ``checkpoint.npz`` (plain numeric arrays) is written first
(`fedcomp.util.files.write_atomically`: temporary file, fsync, rename), then the manifest
``checkpoint.json``, written last the same way, names the round and the sha256 of the ``.npz``
it belongs to. A crash between the two renames leaves a new
``.npz`` next to the old manifest; `load` sees the checksum disagree and refuses the pair
(it would otherwise re-run a round on weights that already include it).

What is saved: the global weights (every array with its exact shape and dtype: 0-d, integer,
bool, fp16 and zero-element arrays included), the round number, the metrics of every round so far,
and the strategy's [`state_dict`][fedcomp.strategies.CompressedStrategy.state_dict]: the inner strategy's
optimizer state where it has one (FedOpt/FedAdam ``m_t``/``v_t``, FedAvgM's momentum) and the
integer rule's rounding remainders, the fp16/bf16 tensors' rounding remainders, EF21's server estimate h and the
round it last folded each node's send in the ``.npz``, the privacy accounting (client-level DP rounds, local-DP
rounds, the epsilon projections of DP-SGD reports) in the manifest. A manifest or weights file without one of
these keys (written by an older version) loads that state with its start value.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Any

import numpy as np

from fedcomp.app.results import finite_or_none
from fedcomp.statedict import copy_array
from fedcomp.strategies.wrapping import OPTIMIZER_PREFIXES
from fedcomp.util.files import write_atomically

WEIGHTS = "checkpoint.npz"
META = "checkpoint.json"
#: Manifest key holding the sha256 (hex) of the weights file it belongs to.
CHECKSUM = "weights-sha256"
#: Array in the weights file that repeats the round, so a torn pair can be named precisely.
_ROUND = "__round__"
#: Prefix of the integer rule's rounding remainders (``CompressedStrategy.int_remainders``).
_INT_REMAINDER = "int-remainder"
#: Prefix of the fp16/bf16 tensors' rounding remainders (``CompressedStrategy.half_remainders``).
_HALF_REMAINDER = "half-remainder"
#: Prefix of EF21's server estimate h (flat float64 per float tensor, ``EF21Aggregate.h``).
_EF21 = "ef21"
#: Prefix of the round EF21 last folded each node's send (``nodes`` uint64, ``rounds`` int64).
_EF21_FOLDED = "ef21-folded"
#: Settings the ServerApp records in the manifest's ``extra`` and compares on resume
#: (``fedcomp.app.server_app``: privacy and codec; `strategy_record`): each must be a JSON object.
_EXTRA_RECORDS = ("privacy-settings", "codec-settings", "strategy-settings", "data-settings")


def _sha256(path: pathlib.Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def save(out_dir: pathlib.Path, server_round: int, weights: dict[str, np.ndarray], strategy: Any,
         rounds: list[dict], extra: dict | None = None) -> None:
    """Write ``checkpoint.npz``, then its manifest ``checkpoint.json``, for ``server_round``.

    Parameters
    ----------
    out_dir : pathlib.Path
        The run's results folder.
    server_round : int
        Last completed round.
    weights : dict of str to np.ndarray
        Global weights after that round (model key order is kept in the JSON).
    strategy : CompressedStrategy or None
        Its [`state_dict`][fedcomp.strategies.CompressedStrategy.state_dict] is saved (None: weights and metrics only).
    rounds : list of dict
        The metrics records so far (as in metrics.json).
    extra : dict, optional
        More JSON-serialisable state (e.g. cumulative MB).
    """
    state = strategy.state_dict() if strategy is not None else {}
    arrays = {f"w/{k}": copy_array(v) for k, v in weights.items()}
    arrays.update(state.get("optimizer", {}))
    arrays.update({f"{_INT_REMAINDER}/{k}": copy_array(v) for k, v in state.get("int-remainders", {}).items()})
    arrays.update({f"{_HALF_REMAINDER}/{k}": copy_array(v) for k, v in state.get("half-remainders", {}).items()})
    arrays.update({f"{_EF21}/{k}": copy_array(v) for k, v in state.get("ef21", {}).items()})
    arrays.update({f"{_EF21_FOLDED}/{k}": copy_array(v) for k, v in state.get("ef21-folded", {}).items()})
    arrays[_ROUND] = np.array(server_round, dtype=np.int64)
    write_atomically(out_dir / WEIGHTS, lambda f: np.savez(f, **arrays))
    meta = {
        "round": server_round, "keys": list(weights), CHECKSUM: _sha256(out_dir / WEIGHTS), "rounds": rounds,
        "extra": extra or {},
        **state.get("privacy", {}),
    }
    # the manifest last: it commits the pair
    write_atomically(out_dir / META, json.dumps(finite_or_none(meta), allow_nan=False).encode())


def _check_pair(meta: dict, digest: str, data: dict, out_dir: pathlib.Path) -> None:
    """Refuse a weights file that is not the one the manifest was written for (a torn pair)."""
    want = meta.get(CHECKSUM)
    if not isinstance(want, str):
        raise ValueError(f"{out_dir / META} has no '{CHECKSUM}' (the weights file's "
                         f"checksum): whether {WEIGHTS} belongs to it cannot be checked, so it is not resumed")
    if want != digest:
        r = data.get(_ROUND)
        ok = isinstance(r, np.ndarray) and r.shape == () and r.dtype == np.int64
        held = f"round {int(r)}" if ok else "another round"
        raise ValueError(
            f"torn checkpoint in {out_dir}: {WEIGHTS} holds {held} (sha256 {digest[:12]}...) but {META} was written "
            f"for round {meta['round']} (sha256 {want[:12]}...); the server stopped between writing the two files. "
            f"Resuming would re-run a round on weights that may already include it: start a new run or restore "
            f"both files from a backup")


def _check_array(v: np.ndarray, what: str) -> None:
    """Plain numeric or bool array, finite where it is floating point (ints and bools have no NaN)."""
    if v.dtype == np.bool_ or np.issubdtype(v.dtype, np.integer):
        return
    if not np.issubdtype(v.dtype, np.inexact) or not np.isfinite(v).all():
        raise ValueError(f"{what} are not finite numbers (dtype {v.dtype})")


def _check_meta(meta: dict, out_dir: pathlib.Path) -> None:
    """Types and ranges of the JSON fields (a hand-edited file must not bypass a privacy budget)."""
    def nonneg_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    def epsilon(e) -> bool:  # None: an infinite epsilon, written as JSON null
        return e is None or (isinstance(e, (int, float)) and not isinstance(e, bool) and e >= 0)

    problems = []
    if not all(isinstance(r, dict) and nonneg_int(r.get("round")) for r in meta["rounds"]):
        problems.append("'rounds' must be a list of round records")
    elif meta["rounds"] and meta["rounds"][-1]["round"] != meta["round"]:
        problems.append("'round' disagrees with the last round record")
    extra = meta.get("extra", {})
    if not isinstance(extra, dict):
        problems.append("'extra' must be an object")
        extra = {}
    for key in _EXTRA_RECORDS:
        if key in extra and not isinstance(extra[key], dict):
            problems.append(f"'extra' '{key}' must be an object (the run's recorded settings)")
    for key in ("cum-mb", "cum-down-mb", "cum-dense-mb", "last-eps"):
        if key in extra and not (epsilon(extra[key]) and (extra[key] is not None or key == "last-eps")):
            problems.append(f"'extra' '{key}' must be a number >= 0")
    for key in ("client-dp-rounds", "local-dp-rounds"):
        meta.setdefault(key, 0 if key == "local-dp-rounds" else None)
        if meta[key] is not None and not nonneg_int(meta[key]):
            problems.append(f"'{key}' must be an integer >= 0")
    if not epsilon(meta.get("epsilon-next", 0.0)):
        problems.append("'epsilon-next' must be an epsilon >= 0")
    if not isinstance(meta.get("epsilon-floor", []), list) or not all(map(epsilon, meta.get("epsilon-floor", []))):
        problems.append("'epsilon-floor' must be a list of epsilons >= 0")
    if problems:
        raise ValueError(f"{out_dir / META}: " + "; ".join(problems))


def _check_folded_rounds(rounds: Any, last_round: int) -> None:
    """EF21's record names no round after the checkpoint's own: a node recorded as folded in a later
    round would be refused for the rest of the run (its h_i can never be from that round)."""
    if isinstance(rounds, np.ndarray) and rounds.size and np.issubdtype(rounds.dtype, np.integer) \
            and int(rounds.max()) > last_round:
        raise ValueError(f"EF21's record of folded sends names round {int(rounds.max())}, after the checkpoint's "
                         f"round {last_round}")


def _half_remainders(data: dict, weights: dict[str, np.ndarray], out_dir: pathlib.Path) -> dict[str, np.ndarray]:
    """The fp16/bf16 rounding remainders of a checkpoint (none in older ones), each checked: float32,
    the tensor's shape, within half an ulp of the saved weight (fp16; bf16 weights are saved as
    their float32 values, so half a bf16 ulp)."""
    out = {k.split("/", 1)[1]: v for k, v in data.items() if k.startswith(_HALF_REMAINDER + "/")}
    for k, v in out.items():
        w = weights.get(k)
        ok = w is not None and v.shape == w.shape and v.dtype == np.float32 and w.dtype in (np.float16, np.float32) \
            and np.isfinite(v).all()
        if ok and v.size:
            half_ulp = np.spacing(np.abs(w)).astype(np.float32) * (0.5 if w.dtype == np.float16 else 2.0**15)
            ok = bool((np.abs(v) <= half_ulp).all())
        if not ok:
            raise ValueError(f"checkpoint in {out_dir}: the rounding remainder of '{k}' is not a float32 array of the "
                             "fp16/bf16 tensor's shape within half an ulp of its weights")
    return out


def load(out_dir: pathlib.Path, strategy: Any,
         model_shapes: dict[str, tuple] | None = None) -> tuple[int, dict[str, np.ndarray], dict]:
    """Read a checkpoint and restore the strategy's state.

    Returns
    -------
    (round, weights, meta)
        The last completed round, the global weights (model key order, each array with the
        shape and dtype it was saved with), and the JSON metadata.

    Raises
    ------
    FileNotFoundError
        No checkpoint in ``out_dir``.
    ValueError
        An unreadable checkpoint, a torn pair (the weights file's sha256 is not the manifest's),
        one that does not fit ``model_shapes``, non-finite weights, or optimizer state the
        inner strategy does not have (naming the file and the problem).

    ``strategy`` (a ``CompressedStrategy``, or None for weights only) gets the saved state
    through its ``load_state_dict``.
    """
    try:
        meta = json.loads((out_dir / META).read_text())
        digest = _sha256(out_dir / WEIGHTS)
        with np.load(out_dir / WEIGHTS, allow_pickle=False) as z:
            data = {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - any parse problem is a bad checkpoint
        raise ValueError(f"checkpoint in {out_dir} is unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("round"), int) or isinstance(meta.get("round"), bool) \
            or meta["round"] < 0 or not isinstance(meta.get("keys"), list) or not isinstance(meta.get("rounds"), list):
        raise ValueError(f"{out_dir / META} is not a fedcomp checkpoint (needs an integer 'round', 'keys', 'rounds')")
    _check_pair(meta, digest, data, out_dir)
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
        _check_array(v, f"checkpoint in {out_dir}: weights of '{k}'")
    remainders = {k.split("/", 1)[1]: v for k, v in data.items() if k.startswith(_INT_REMAINDER + "/")}
    for k, v in remainders.items():
        if k not in weights or v.shape != weights[k].shape or v.dtype != np.float64 or not np.isfinite(v).all() \
                or (v.size and float(np.abs(v).max()) > 0.5):
            raise ValueError(f"checkpoint in {out_dir}: the integer rule's remainder of '{k}' is not a float64 array "
                             "of the tensor's shape with entries in [-0.5, 0.5]")
    halves = _half_remainders(data, weights, out_dir)
    if strategy is not None:
        optimizer = {k: v for k, v in data.items() if k.split("/", 1)[0] in OPTIMIZER_PREFIXES}
        try:
            ef21 = {k.split("/", 1)[1]: v for k, v in data.items() if k.startswith(_EF21 + "/")}
            folded = {k.split("/", 1)[1]: v for k, v in data.items() if k.startswith(_EF21_FOLDED + "/")}
            _check_folded_rounds(folded.get("rounds"), meta["round"])
            strategy.load_state_dict({"optimizer": optimizer, "privacy": meta, "int-remainders": remainders,
                                      "half-remainders": halves, "ef21": ef21, "ef21-folded": folded},
                                     {k: tuple(v.shape) for k, v in weights.items()})
        except ValueError as exc:
            raise ValueError(f"checkpoint in {out_dir}: {exc}") from None
    return int(meta["round"]), weights, meta
