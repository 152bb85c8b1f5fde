"""What a client sent in a secure round that fails is not lost: the error-feedback ledger under SecAgg+.

Clients run fedcomp's secure mod (shared random-k, pre-rounded onto SecAgg+'s grid) in the in-process
SecAgg+ federation of `tests.secagg.helpers`. Every reply of the collect stage is recorded: the vector
the client sent (decoded to the model's coordinates), the residual it started from and the residual it
kept. The tests check the whole ledger, per client and for the model:

- a round whose sum is not applied (unmasking fails, the server refuses the sum, too few masked
  vectors, the client's own vector lost) leaves the client's residual exactly as it was before that
  round: what it sent is back in it, less the update it trained in that round, which the client
  trains again from the same, unchanged model;
- per client: the vectors of the applied rounds plus its final residual equal the sum of the updates
  of those rounds (nothing lost, nothing applied twice);
- the model moved by exactly the weighted means of the vectors of the applied rounds.

Also: a node not sampled after the failed round (its pending residual rolled back whenever it is next
sampled, across a SuperNode restart through ``state-dir``), two failures in a row, a dropout at
unmasking in a round that succeeds (its vector is in the sum: committed), and a server that started
over (a new run): the earlier run's residual is not carried into it.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from flwr.app import Error, Message, RecordDict
from flwr.common import parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.compat.common import recorddict_compat as compat
from flwr.server.strategy import FedAvg

import fedcomp.secagg.client as secagg_client
from fedcomp.protocol.messages import SECAGG_APPLIED_KEY, SECAGG_ROTATION_KEY, SECAGG_SEED_KEY
from fedcomp.secagg.encoding import SharedProjection, flower_weight
from fedcomp.secagg.protocol_packing import pack_masked, unpack_masked
from fedcomp.secagg.residual import SECAGG_RESIDUAL_KEY
from tests.secagg import helpers

DIM = 2050
Q16 = 1 << 16
N = 4
#: float32 storage of the model and the residual, over a few rounds
TOL = 2e-6


def _flat(d):
    return np.concatenate([d["w"].reshape(-1), d["b"].reshape(-1)]).astype(np.float64)


def _stage(m):
    rec = m.content.config_records.get(RECORD_KEY_CONFIGS)
    return None if rec is None else rec.get(Key.STAGE)


def _ledger(monkeypatch):
    """Record, per (round, partition), what the secure mod did: ``sent`` (the vector the client masked,
    in the model's coordinates, before SecAgg+'s weight), ``start`` (the residual it added to its
    update), ``kept`` (its new residual, pending), ``applied`` (the server's applied-round key),
    ``weight`` (its SecAgg+ weight) and ``global`` (the flat model it trained from)."""
    rec = {}
    real = secagg_client.shared_randomk_mod

    def recording(msg, ctxt, call_next):
        reply = real(msg, ctxt, call_next)
        cfg = msg.content.config_records.get("fitins.config", {})
        if reply.has_error() or SECAGG_SEED_KEY not in cfg:
            return reply
        fitres = compat.recorddict_to_fitres(reply.content, keep_input=True)
        proj = SharedProjection(DIM, float(cfg["density"]), int(cfg[SECAGG_SEED_KEY]), bool(cfg[SECAGG_ROTATION_KEY]))
        state = ctxt.state.array_records[SECAGG_RESIDUAL_KEY]
        ins = parameters_to_ndarrays(compat.arrayrecord_to_parameters(msg.content.array_records["fitins.parameters"],
                                                                    keep_input=True))
        g = np.concatenate([a.reshape(-1).astype(np.float64) for a in ins if a.dtype.kind == "f"])
        rec[(int(cfg["server-round"]), int(ctxt.node_config["partition-id"]))] = {
            "sent": proj.decode(parameters_to_ndarrays(fitres.parameters)[0]),
            "start": state["committed"].numpy().astype(np.float64) if "committed" in state else np.zeros(DIM),
            "kept": state["pending"].numpy().astype(np.float64),
            "applied": int(cfg[SECAGG_APPLIED_KEY]),
            "weight": flower_weight(fitres.num_examples, 1000.0, Q16),
            "global": g,
        }
        return reply

    monkeypatch.setattr(secagg_client, "shared_randomk_mod", recording)
    return rec


def _update(pid, g_flat):
    """The update the client's training produced from the flat model ``g_flat`` (float32 arithmetic)."""
    d = _flat(helpers.client_delta(pid))
    g32 = g_flat.astype(np.float32)
    return (g32 + d.astype(np.float32)).astype(np.float64) - g32.astype(np.float64)


def _check_ledger(rec, applied_rounds, models, rounds):
    """The three checks of the module docstring; ``applied_rounds``: {round: partitions whose vectors
    were in the applied sum}."""
    g0 = _flat(helpers.global_model())
    for (rnd, pid), r in rec.items():  # the client's own bookkeeping, every round
        np.testing.assert_allclose(r["kept"], r["start"] + _update(pid, r["global"]) - r["sent"], atol=TOL)
    for pid in range(N):
        mine = sorted(rnd for rnd, p in rec if p == pid)
        for a, b in itertools.pairwise(mine):  # the residual a round starts from
            want = rec[(a, pid)]["kept"] if pid in applied_rounds.get(a, ()) else rec[(a, pid)]["start"]
            np.testing.assert_allclose(rec[(b, pid)]["start"], want, atol=TOL,
                                       err_msg=f"partition {pid}, round {b} after round {a}")
            if pid not in applied_rounds.get(a, ()):  # what it sent in round a is back, less round a's update
                back = rec[(a, pid)]["kept"] + rec[(a, pid)]["sent"] - _update(pid, rec[(a, pid)]["global"])
                np.testing.assert_allclose(rec[(b, pid)]["start"], back, atol=TOL)
        applied = [rnd for rnd in mine if pid in applied_rounds.get(rnd, ())]
        last = rec[(mine[-1], pid)]["kept"] if mine[-1] in applied else rec[(mine[-1], pid)]["start"]
        sent = sum((rec[(rnd, pid)]["sent"] for rnd in applied), np.zeros(DIM))
        updates = sum((_update(pid, rec[(rnd, pid)]["global"]) for rnd in applied), np.zeros(DIM))
        np.testing.assert_allclose(sent + last, updates, atol=TOL * (1 + len(applied)),
                                   err_msg=f"partition {pid}: sent + residual != its applied updates")
    moved = np.zeros(DIM)
    for rnd, pids in applied_rounds.items():
        w = np.array([rec[(rnd, p)]["weight"] for p in pids])
        moved += sum(wi * rec[(rnd, p)]["sent"] for p, wi in zip(pids, w)) / w.sum()
    np.testing.assert_allclose(_flat(models[rounds]) - g0, moved, atol=TOL * (1 + len(applied_rounds)))


def _grid(fail=lambda rnd, stage, pid: False, reweight=lambda rnd: False, restart=(), run_id=None):
    """A round-counting grid: ``fail(round, stage, partition)`` turns that reply into an error;
    in a round where ``reweight(round)``, partition 1 masks an inflated weight (the server refuses the
    sum); before each round in ``restart`` every SuperNode restarts (empty ``context.state``)."""

    class G(helpers.RoundCountingGrid):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            if run_id is not None:
                for ctx in self.contexts.values():
                    ctx.run_id = run_id

        def on_round(self, server_round):
            if server_round in restart:
                for ctx in self.contexts.values():
                    ctx.state = RecordDict()

        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            out = list(super().send_and_receive(messages, timeout=timeout))
            pid = {nid: c.node_config["partition-id"] for nid, c in self.contexts.items()}
            stage = next((_stage(m) for m in messages if _stage(m)), None)
            replies = []
            for m, r in zip(messages, out):
                p = pid[m.metadata.dst_node_id]
                if fail(self.round, stage, p):
                    r = Message(Error(code=2, reason="dropped by the test"), reply_to=m)
                elif stage == Stage.COLLECT_MASKED_VECTORS and p == 1 and reweight(self.round) and not r.has_error():
                    rec = r.content.config_records[RECORD_KEY_CONFIGS]
                    blobs = list(rec[Key.MASKED_PARAMETERS])
                    bits = blobs[0][5]
                    rec[Key.MASKED_PARAMETERS] = [pack_masked((unpack_masked(blobs[0], bits) + 3 * Q16) % (1 << bits),
                                                              bits), blobs[1]]
                replies.append(r)
            return replies
    return G


FAILURES = {
    # every unmask reply lost: too few shares, the sum cannot be unmasked
    "unmask-lost": {"fail": lambda rnd, st, pid: rnd == 2 and st == Stage.UNMASK},
    # a client masked another weight than it reported: the server refuses the sum
    "sum-refused": {"reweight": lambda rnd: rnd == 2},
    # only one masked vector arrives: too few for the threshold; that client sent, nothing was applied
    "too-few-vectors": {"fail": lambda rnd, st, pid: rnd == 2 and st == Stage.COLLECT_MASKED_VECTORS and pid != 3},
}


@pytest.mark.parametrize("rotation", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize("how", list(FAILURES))
def test_what_a_client_sent_in_a_failed_round_is_back_in_its_residual(monkeypatch, how, rotation):
    """Round 1 applied (every client now holds a residual), round 2 fails after the masked vectors,
    round 3 applied."""
    rec = _ledger(monkeypatch)
    monkeypatch.setattr(helpers, "RecordingGrid", _grid(**FAILURES[how]))
    models, strategy, workflow, _ = helpers.run_rounds(3, N, 0.5, rotation=rotation)
    assert sorted(strategy.history) == [1, 3] and 2 in workflow.round_skipped
    assert all(np.array_equal(models[2][k], models[1][k]) for k in models[1])  # round 2 applied nothing
    sent_in_2 = [p for rnd, p in rec if rnd == 2]
    assert sent_in_2  # the failure came after at least one client had sent its masked vector
    assert {rec[(3, p)]["applied"] for p in range(N)} == {1}
    for p in sent_in_2:  # its round-1 residual, committed at round 2, is what round 3 starts from
        assert np.linalg.norm(rec[(2, p)]["start"]) > 0
        np.testing.assert_array_equal(rec[(3, p)]["start"], rec[(2, p)]["start"])
    _check_ledger(rec, {1: range(N), 3: range(N)}, models, 3)


def test_two_failed_rounds_in_a_row(monkeypatch):
    rec = _ledger(monkeypatch)
    monkeypatch.setattr(helpers, "RecordingGrid", _grid(fail=lambda rnd, st, pid: rnd in (2, 3) and st == Stage.UNMASK))
    models, strategy, _, _ = helpers.run_rounds(4, N, 0.5)
    assert sorted(strategy.history) == [1, 4]
    assert {rec[(4, p)]["applied"] for p in range(N)} == {1}
    _check_ledger(rec, {1: range(N), 4: range(N)}, models, 4)


def test_the_first_round_failing(monkeypatch):
    rec = _ledger(monkeypatch)
    monkeypatch.setattr(helpers, "RecordingGrid", _grid(fail=lambda rnd, st, pid: rnd == 1 and st == Stage.UNMASK))
    models, strategy, _, _ = helpers.run_rounds(2, N, 0.5)
    assert sorted(strategy.history) == [2]
    assert all(not rec[(2, p)]["start"].any() for p in range(N))  # back to no residual at all
    _check_ledger(rec, {2: range(N)}, models, 2)


def test_a_dropout_at_unmasking_in_a_round_that_succeeds_commits_its_residual(monkeypatch):
    """Node 0 sends its masked vector, then drops at unmasking; the others hold enough shares, so its
    vector is in the applied sum: it must commit (a rollback would send that mass a second time)."""
    rec = _ledger(monkeypatch)
    monkeypatch.setattr(helpers, "RecordingGrid", _grid(fail=lambda rnd, st, pid: rnd == 2 and st == Stage.UNMASK
                                                        and pid == 0))
    models, strategy, _workflow, _ = helpers.run_rounds(3, N, 0.5, threshold=0.5)
    assert sorted(strategy.history) == [1, 2, 3] and strategy.history[2]["num-replies"] == N
    assert rec[(3, 0)]["applied"] == 2
    _check_ledger(rec, {1: range(N), 2: range(N), 3: range(N)}, models, 3)


def test_a_vector_lost_in_a_round_that_succeeds_is_rolled_back(monkeypatch):
    rec = _ledger(monkeypatch)
    monkeypatch.setattr(helpers, "RecordingGrid", _grid(fail=lambda rnd, st, pid: rnd == 2
                                                        and st == Stage.COLLECT_MASKED_VECTORS and pid == 0))
    models, strategy, _, _ = helpers.run_rounds(3, N, 0.5)
    assert strategy.history[2]["num-replies"] == N - 1
    assert rec[(3, 0)]["applied"] == 1 and rec[(3, 1)]["applied"] == 2
    _check_ledger(rec, {1: range(N), 2: range(1, N), 3: range(N)}, models, 3)


class _SkipNode0(FedAvg):
    """FedAvg that leaves partition 0 (node 1000) out of the rounds in ``skip``."""

    skip: tuple[int, ...] = ()

    def configure_fit(self, server_round, parameters, client_manager):
        sample = super().configure_fit(server_round, parameters, client_manager)
        return [(c, ins) for c, ins in sample if not (server_round in self.skip and c.node_id == 1000)]


@pytest.mark.parametrize("restart", [False, True], ids=["same-supernode", "supernode-restarted"])
def test_a_node_not_sampled_after_the_failed_round_rolls_back_when_next_sampled(monkeypatch, tmp_path, restart):
    """Round 2 fails; node 0 is not sampled in round 3 (applied); before round 4 every SuperNode
    restarts (with ``state-dir``, so its residual is read back from its file); in round 4 node 0
    rolls round 2 back to its round-1 residual, the others commit round 3."""
    rec = _ledger(monkeypatch)
    monkeypatch.setattr(_SkipNode0, "skip", (3,))
    monkeypatch.setattr(helpers, "RecordingGrid", _grid(fail=lambda rnd, st, pid: rnd == 2 and st == Stage.UNMASK,
                                                        restart=(4,) if restart else ()))
    cfgs = [{"state-dir": str(tmp_path)} for _ in range(N)]
    models, strategy, _, _ = helpers.run_rounds(4, N, 0.5, inner_cls=_SkipNode0, node_configs=cfgs,
                                                min_fit_clients=N - 1)
    assert sorted(strategy.history) == [1, 3, 4] and (3, 0) not in rec
    assert rec[(4, 0)]["applied"] == 1 and rec[(4, 1)]["applied"] == 3
    _check_ledger(rec, {1: range(N), 3: range(1, N), 4: range(N)}, models, 4)


def test_a_server_that_started_over_does_not_get_the_earlier_runs_residual(monkeypatch, tmp_path):
    """A first run leaves residuals (committed and pending) in the nodes' state dir; the server starts
    over (a new run, from the initial model, round 1 again): its clients start from no residual, as
    in a run on a fresh state dir (the earlier run's residual belongs to a model this run does not have)."""
    cfgs = [{"state-dir": str(tmp_path)} for _ in range(N)]
    monkeypatch.setattr(helpers, "RecordingGrid", _grid(fail=lambda rnd, st, pid: rnd == 3 and st == Stage.UNMASK))
    helpers.run_rounds(3, N, 0.5, node_configs=cfgs)
    assert len(list(tmp_path.glob("secagg-residual-*.npz"))) >= N
    rec = _ledger(monkeypatch)
    monkeypatch.setattr(helpers, "RecordingGrid", _grid(run_id=2))
    models, _strategy, _, _ = helpers.run_rounds(1, N, 0.5, node_configs=cfgs)
    assert all(not rec[(1, p)]["start"].any() for p in range(N))
    _check_ledger(rec, {1: range(N)}, models, 1)


def test_a_new_run_that_reaches_past_the_earlier_runs_rounds_does_not_get_its_residual(monkeypatch, tmp_path):
    """The same, for a node first sampled in the new run at a round past the one its file holds (its
    committed residual is of round 1, its pending one of round 2, applied)."""
    cfgs = [{"state-dir": str(tmp_path)} for _ in range(N)]
    helpers.run_rounds(2, N, 0.5, node_configs=cfgs)
    rec = _ledger(monkeypatch)
    monkeypatch.setattr(_SkipNode0, "skip", (1, 2))
    monkeypatch.setattr(helpers, "RecordingGrid", _grid(run_id=2))
    models, _, _, _ = helpers.run_rounds(3, N, 0.5, node_configs=cfgs, inner_cls=_SkipNode0, min_fit_clients=N - 1)
    assert not rec[(3, 0)]["start"].any()
    _check_ledger(rec, {1: range(1, N), 2: range(1, N), 3: range(N)}, models, 3)


def test_model_and_residuals_hold_the_applied_rounds_updates(monkeypatch):
    """The model-level view of the ledger: after round 1 applied, round 2 failed and round 3 applied,
    the model's change plus the clients' weighted mean residual is the weighted mean update of two
    rounds, as in a run of two rounds in which nothing failed (the failed round adds nothing: its
    update was trained again, from the same model, in round 3)."""
    rec = _ledger(monkeypatch)
    monkeypatch.setattr(helpers, "RecordingGrid", _grid(**FAILURES["unmask-lost"]))
    failed, *_ = helpers.run_rounds(3, N, 0.5)
    rec_failed = dict(rec)
    rec.clear()
    monkeypatch.setattr(helpers, "RecordingGrid", _grid())
    clean, *_ = helpers.run_rounds(2, N, 0.5)
    w = np.array([rec_failed[(1, p)]["weight"] for p in range(N)])
    g0 = _flat(helpers.global_model())
    mean_update = sum(wi * _flat(helpers.client_delta(p)) for p, wi in enumerate(w)) / w.sum()
    held_failed = sum(wi * rec_failed[(3, p)]["kept"] for p, wi in enumerate(w)) / w.sum()
    held_clean = sum(wi * rec[(2, p)]["kept"] for p, wi in enumerate(w)) / w.sum()
    np.testing.assert_allclose(_flat(failed[3]) - g0 + held_failed, 2 * mean_update, atol=1e-5)
    np.testing.assert_allclose(_flat(clean[2]) - g0 + held_clean, 2 * mean_update, atol=1e-5)


def test_a_file_without_a_run_is_used_only_for_a_later_round(tmp_path):
    """A residual file written without its run (an older fedcomp): read back for a later round (a
    restarted SuperNode), not for its own round or an earlier one (a server that started over)."""
    from flwr.app import Context

    from fedcomp.client.state import save_residuals
    from fedcomp.secagg.residual import settled_residual

    committed = np.linspace(-1, 1, DIM).astype(np.float32)
    pending = np.full(DIM, 0.5, np.float32)
    for rnd, applied, want in [(3, 2, pending), (3, 0, committed), (2, 2, None), (1, 2, None)]:
        save_residuals(tmp_path / "secagg-residual-0.npz", {"committed": committed, "pending": pending}, 2)
        ctx = Context(run_id=7, node_id=1000, node_config={"partition-id": 0, "state-dir": str(tmp_path)},
                      state=RecordDict(), run_config={})
        got = settled_residual(ctx, applied, DIM, rnd)
        if want is None:
            assert got is None, (rnd, applied)
        else:
            np.testing.assert_array_equal(got, want)
