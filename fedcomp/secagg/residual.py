"""The secure path's error-feedback residual, committed only once the round's sum is applied.

A client computes its new residual in the collect stage, but the round can still fail after that
(a dropout at unmasking, too few shares, a refused sum), or go on without this client's vector
(its reply was lost or malformed). The new residual is therefore kept as *pending*, with its round;
the server tells each client, in its next train config, the last round whose applied sum included
its vector (``fedcomp-secagg-applied-round``, `fedcomp.protocol.messages.SECAGG_APPLIED_KEY`).
The pending residual of that round is committed; one of any other round is dropped (rolled back to
the committed one: the update it came from was never applied, and the client trains again from the
same model). A server that does not send the key (an older fedcomp) gets the residual committed at
once.

Dropping the pending residual is what keeps the error-feedback ledger whole: what the client sent in a
round whose sum was not applied is back in its residual, less the update it trained in that round;
that update it trains again from the same model (the server applied nothing), so keeping it as well
would apply one round's training twice, and a run of failed rounds would pile up that many updates
for the next applied one.

Both live in ``context.state`` and, when node config ``state-dir`` (or run config
``client-state-dir``) names a folder, in ``secagg-residual-<partition-id or node id>.npz`` there
(`fedcomp.client.state.save_residuals`, read back without pickle), so that a restarted
SuperNode continues from its residual. The file names its run: a server that starts over (a new
run: the secure path has no checkpoint to resume from) does not get an earlier run's residual, which
belongs to a model that run does not have; a file without a run (an older fedcomp) is used only for a
round after the one it was written in.
"""

from __future__ import annotations

import pathlib
from logging import INFO, WARNING

import numpy as np
from flwr.app import Array, ArrayRecord, Context
from flwr.common.logger import log

from fedcomp.client.state import load_residuals_of_round, save_residuals, state_files

#: Key in ``context.state`` of the secure path's residuals: ``committed`` and ``pending`` (float32,
#: shape (d,), each optional) and ``round`` (int64, the pending residual's round).
SECAGG_RESIDUAL_KEY = "fedcomp.secagg-residual"


def _file(ctxt: Context) -> pathlib.Path | None:
    files = state_files(ctxt)
    return None if files is None else files.residual.with_name("secagg-" + files.residual.name)


def _run_tag(ctxt: Context) -> np.ndarray:
    """This node's run id as the file keeps it: float64 ``[high 32 bits, low 32 bits]`` (exact; the
    residual file holds float arrays only)."""
    run = int(ctxt.run_id or 0)
    return np.array([run >> 32, run & 0xFFFFFFFF], dtype=np.float64)


def _read(ctxt: Context, server_round: int = 0) -> tuple[np.ndarray | None, np.ndarray | None, int]:
    """(committed, pending, pending round) from ``context.state``, else the node's file: nothing from a
    file of another run, or, without a run in it, of round ``server_round`` or later."""
    if SECAGG_RESIDUAL_KEY in ctxt.state.array_records:
        rec = ctxt.state.array_records[SECAGG_RESIDUAL_KEY]
        arrays = {k: rec[k].numpy() for k in rec}
        rnd = int(arrays.pop("round", np.array(0)).reshape(()))
    else:
        path = _file(ctxt)
        rnd, arrays = load_residuals_of_round(path, 0) if path is not None else (0, {})
        run = arrays.pop("run", None)
        other_run = run is not None and not np.array_equal(run, _run_tag(ctxt))
        if arrays and (other_run or (run is None and 0 < server_round <= rnd)):
            where = (f"run {int(run[0]) << 32 | int(run[1])}, this is run {ctxt.run_id}" if other_run
                     else f"round {rnd}, this is round {server_round}")
            log(WARNING, "fedcomp secagg node %s: %s is the residual of another run (%s): the server started over, "
                "this node starts from no residual", ctxt.node_id, path.name, where)
            return None, None, 0
    return arrays.get("committed"), arrays.get("pending"), rnd


def _write(ctxt: Context, committed: np.ndarray | None, pending: np.ndarray | None, server_round: int) -> None:
    arrays = {k: np.asarray(v, dtype=np.float32) for k, v in (("committed", committed), ("pending", pending))
              if v is not None}
    ctxt.state.array_records[SECAGG_RESIDUAL_KEY] = ArrayRecord(
        {**{k: Array(v) for k, v in arrays.items()}, "round": Array(np.array(server_round, dtype=np.int64))})
    path = _file(ctxt)
    if path is not None:
        try:
            save_residuals(path, {**arrays, "run": _run_tag(ctxt)}, server_round)
        except OSError as exc:
            log(INFO, "fedcomp secagg: cannot persist the residual to %s (%s)", path, exc)


def settled_residual(ctxt: Context, applied_round: int | None, dim: int, server_round: int = 0) -> np.ndarray | None:
    """The residual this round starts from: the committed one, after settling a pending one against
    ``applied_round`` (commit it if its round is the one the server applied with this client's
    vector, else drop it). None: no residual of ``dim`` entries.

    Parameters
    ----------
    ctxt : Context
        This node's context.
    applied_round : int or None
        The train config's ``fedcomp-secagg-applied-round``; None (a server that does not send it):
        nothing is pending.
    dim : int
        Entries of this model's float update.
    server_round : int
        This round (0: unknown); a residual file without a run read back for this round or an earlier
        one is from a server that started over: not used.
    """
    committed, pending, pending_round = _read(ctxt, server_round)
    if pending is not None and applied_round is not None:
        if pending_round == applied_round:
            committed = pending
        else:
            log(INFO, "fedcomp secagg node %s: the sum of round %d was not applied with this node's vector (last "
                "applied: %d): its residual is rolled back", ctxt.node_id, pending_round, applied_round)
        _write(ctxt, committed, None, pending_round)
    return committed if committed is not None and committed.shape == (dim,) else None


def keep_residual(ctxt: Context, committed: np.ndarray | None, new: np.ndarray, server_round: int,
                  applied_round: int | None) -> None:
    """Keep this round's residual ``new`` (float, shape (d,)) as pending next to ``committed``; a server
    that sends no ``applied_round`` gets it committed at once."""
    if applied_round is None:
        _write(ctxt, new, None, server_round)
    else:
        _write(ctxt, committed, new, server_round)


def latest_residual(ctxt: Context) -> np.ndarray | None:
    """The newest residual this node holds (pending if any, else committed): float32 shape (d,)."""
    committed, pending, _ = _read(ctxt)
    return pending if pending is not None else committed
