"""What a client keeps between rounds: the error-feedback residuals (and codec state) and the
DP-SGD accountant's history.

Both live in ``context.state`` (Flower keeps it per node across the rounds of one run) and,
when node config ``state-dir`` (or run config ``client-state-dir``) names a folder, in files
there, so that a restarted SuperNode or a resumed run continues where it stopped:
``residual-<partition-id or node id>.npz`` and ``accountant-<partition-id or node id>.json``.
Every file is written by `fedcomp.util.files.write_atomically` and read back without pickle.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from logging import INFO, WARNING

import numpy as np
from flwr.app import Array, ArrayRecord, Context, MetricRecord
from flwr.common.logger import log

from fedcomp.privacy import STATE_KEYS
from fedcomp.protocol.messages import RESIDUAL_ROUND_KEY, RESIDUAL_STATE_KEY
from fedcomp.statedict import numpy_view
from fedcomp.util.files import write_atomically

#: Key in ``context.state`` of the DP-SGD accountant's history (a MetricRecord of float lists).
DP_ACCOUNTANT_KEY = "fedcomp.dp-accountant"


@dataclass(frozen=True)
class StateFiles:
    """This node's state files (see the module docstring)."""

    residual: pathlib.Path
    accountant: pathlib.Path


def state_files(context: Context) -> StateFiles | None:
    """The node's state files if node config ``state-dir`` (or run config ``client-state-dir``)
    names a folder, else None."""
    folder = context.node_config.get("state-dir") or context.run_config.get("client-state-dir") or ""
    if not isinstance(folder, str) or not folder:
        return None
    who = context.node_config.get("partition-id", context.node_id)
    base = pathlib.Path(folder).expanduser()
    return StateFiles(base / f"residual-{who}.npz", base / f"accountant-{who}.json")


# -- error-feedback residuals ---------------------------------------------------------------------
def previous_path(path: pathlib.Path) -> pathlib.Path:
    """Where `save_residuals` keeps the residuals of the round before (``residual-3.prev.npz``)."""
    return path.with_name(path.name.removesuffix(".npz") + ".prev.npz")


def _saved_round(path: pathlib.Path) -> int | None:
    """The round a residual file was written in (None: no file, or not readable)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            return int(z["__round__"].reshape(()))
    except Exception:  # noqa: BLE001 - a missing or bad file has no round
        return None


def save_residuals(path: pathlib.Path, residuals: dict[str, np.ndarray], server_round: int) -> None:
    """Persist error-feedback residuals: plain ``.npz`` of numeric arrays plus the round they were
    computed in (read back with ``allow_pickle=False``).

    The file of an earlier round is first renamed to `previous_path`: a server that stops
    after the clients saved round R+1 but before its checkpoint of R+1 resumes at round R+1, and
    the clients then continue from their round-R state (what the server's checkpoint matches:
    EF21's estimate h is the mean of the clients' h_i). A rerun of the same round keeps the
    previous file as it is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    saved = _saved_round(path)
    if saved is not None and saved < server_round:
        path.replace(previous_path(path))
    arrays = {"__round__": np.array(server_round, dtype=np.int64), **{f"r/{k}": v for k, v in residuals.items()}}
    write_atomically(path, lambda f: np.savez(f, **arrays))


def _read_residuals(path: pathlib.Path) -> tuple[int, dict[str, np.ndarray]]:
    """(round, residuals) of a residual file.

    Raises
    ------
    Exception
        Unreadable, or non-float or non-finite residuals."""
    with np.load(path, allow_pickle=False) as z:
        saved_round = int(z["__round__"].reshape(()))
        res = {k[2:]: z[k] for k in z.files if k.startswith("r/")}
    if not all(np.issubdtype(v.dtype, np.floating) and np.isfinite(v).all() for v in res.values()):
        raise ValueError("non-finite or non-float residual")
    return saved_round, res


def load_residuals(path: pathlib.Path, before_round: int) -> dict[str, np.ndarray]:
    """Residuals saved by `save_residuals` in a round before ``before_round``: the node's
    file, else (the file is from ``before_round`` or later: the server resumed from an older
    checkpoint) the previous round's file if that one is before ``before_round``; {} if none
    fits or the file is unreadable (logged). ``before_round`` 0: the file as it is."""
    return load_residuals_of_round(path, before_round)[1]


def load_residuals_of_round(path: pathlib.Path, before_round: int) -> tuple[int, dict[str, np.ndarray]]:
    """`load_residuals` with the round they were saved in: ``(round, residuals)``, ``(0, {})``
    when none fits."""
    if not path.exists():
        return 0, {}
    try:
        saved_round, res = _read_residuals(path)
    except Exception as exc:  # noqa: BLE001 - a bad local file must not stop the node: start from zero
        log(WARNING, "fedcomp: ignoring unreadable residual file %s (%s: %s)", path, type(exc).__name__, exc)
        return 0, {}
    if saved_round < before_round or before_round == 0:
        return saved_round, res
    prev = previous_path(path)
    try:
        prev_round, prev_res = _read_residuals(prev) if prev.exists() else (None, {})
    except Exception as exc:  # noqa: BLE001
        log(WARNING, "fedcomp: ignoring unreadable residual file %s (%s: %s)", prev, type(exc).__name__, exc)
        return 0, {}
    if prev_round is not None and prev_round < before_round:
        log(INFO, "fedcomp: round %d: %s is from round %d (the server resumed from an earlier checkpoint); "
            "continuing from round %d's residuals in %s", before_round, path.name, saved_round, prev_round, prev.name)
        return prev_round, prev_res
    log(WARNING, "fedcomp: round %d: %s is from round %d and no saved residual is from before round %d (the "
        "server started again or resumed from a checkpoint more than one round back): starting from a zero "
        "residual; under EF21 the server's estimate still holds this client's earlier share (a server that folded this "
        "node's sends refuses its replies: EF21_STATE_MISMATCH)", before_round,
        path.name, saved_round, before_round)
    return 0, {}


def residuals_of(context: Context, files: StateFiles | None, server_round: int) -> tuple[int, dict[str, np.ndarray]]:
    """The residuals of the earlier rounds and the round they were kept in: ``context.state``, else
    the node's file, else none (round 0). The round is what EF21's check compares with the server's
    (`fedcomp.protocol.messages.ESTIMATE_ROUND_METRIC`)."""
    if RESIDUAL_STATE_KEY in context.state:  # read-only views of the kept bytes (no model-sized copy)
        kept = context.state.get(RESIDUAL_ROUND_KEY)
        return (int(kept["round"]) if kept is not None else 0,
                {k: numpy_view(a) for k, a in context.state[RESIDUAL_STATE_KEY].items()})
    if files is not None:
        return load_residuals_of_round(files.residual, before_round=server_round)
    return 0, {}


def keep_residuals(context: Context, files: StateFiles | None, residuals: dict[str, np.ndarray],
                   server_round: int) -> None:
    """Keep the new residuals in ``context.state`` and the node's file (a failed write is logged:
    the in-memory residual stays consistent with what is sent)."""
    if RESIDUAL_STATE_KEY in context.state:  # the old residual's bytes go before the new ones are made
        del context.state[RESIDUAL_STATE_KEY]
    context.state[RESIDUAL_STATE_KEY] = ArrayRecord({k: Array(v) for k, v in residuals.items()})
    context.state[RESIDUAL_ROUND_KEY] = MetricRecord({"round": int(server_round)})
    if files is not None:
        try:
            save_residuals(files.residual, residuals, server_round)
        except OSError as exc:
            log(WARNING, "fedcomp: cannot persist the residual to %s (%s)", files.residual, exc)


# -- the DP-SGD accountant ------------------------------------------------------------------------
def load_accountant(path: pathlib.Path) -> dict:
    """A persisted DP-SGD accountant history; an unreadable one stops training (epsilon must never
    silently restart from zero).

    Raises
    ------
    ValueError
        The file is not a JSON object of equal-length number lists.
    """
    try:
        state = json.loads(path.read_text())
        lists = [state[k] for k in STATE_KEYS]
        ok = all(isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
                 for v in lists) and len({len(v) for v in lists}) == 1
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"privacy accountant file {path} is unreadable ({exc}); refusing to train") from None
    if not ok:
        raise ValueError(f"privacy accountant file {path} is malformed; refusing to train")
    return state


def accountant_of(context: Context, files: StateFiles | None) -> dict | None:
    """The accountant history of the earlier rounds: ``context.state``, else the node's file, else
    None (the first round).

    Raises
    ------
    ValueError
        As `load_accountant`.
    """
    if DP_ACCOUNTANT_KEY in context.state:
        return dict(context.state[DP_ACCOUNTANT_KEY])
    if files is not None and files.accountant.exists():
        return load_accountant(files.accountant)
    return None


def keep_accountant(context: Context, files: StateFiles | None, state: dict[str, list[float]]) -> None:
    """Keep the accountant history in ``context.state`` and the node's file (a failed write raises:
    an accountant that is not kept would restart epsilon from zero after a restart)."""
    context.state[DP_ACCOUNTANT_KEY] = MetricRecord(state)
    if files is not None:
        files.accountant.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(files.accountant, json.dumps(state).encode())
