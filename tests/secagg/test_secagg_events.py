"""Ordinary events on the SecAgg+ path: failed rounds and dropouts lose no
error feedback, a restarted SuperNode keeps its residual, degenerate samples skip the round,
mis-assembly names the mismatch, bytes are the server's own figures."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Error, Message, RecordDict
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

from fedcomp.secagg.encoding import SharedProjection, flower_weight, quantization_bound, round_seed
from tests.secagg import helpers

DIM = 2050
Q16 = 1 << 16


def _stage(m):
    rec = m.content.config_records.get(RECORD_KEY_CONFIGS)
    return None if rec is None else rec.get(Key.STAGE)


def _flat(d):
    return np.concatenate([d["w"].reshape(-1), d["b"].reshape(-1)]).astype(np.float64)


def _fault_grid(fail):
    """``fail(round, stage, partition) -> bool``: that node's reply at that stage becomes an error."""

    class G(helpers.RoundCountingGrid):
        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            out = list(super().send_and_receive(messages, timeout=timeout))
            pid = {nid: c.node_config["partition-id"] for nid, c in self.contexts.items()}
            stage = next((_stage(m) for m in messages if _stage(m)), None)
            return [Message(Error(code=2, reason="dropped by the test"), reply_to=m)
                    if fail(self.round, stage, pid[m.metadata.dst_node_id]) else r
                    for m, r in zip(messages, out)]
    return G


def _mean_update(pids, rnd, density=0.5):
    """The plain random-k mean of round ``rnd``'s shared positions for clients without residual."""
    proj = SharedProjection(DIM, density, round_seed(3, rnd))
    from tests.secagg.helpers import client_delta, num_examples
    w = [flower_weight(num_examples(p), 1000.0, Q16) for p in pids]
    return proj, sum(wi * proj.encode(_flat(client_delta(p)))[0] for p, wi in zip(pids, w)) / sum(w), w


def _model_delta(new, base):
    return _flat({k: new[k].astype(np.float64) - base[k] for k in ("w", "b")})


def test_a_round_that_fails_after_collecting_loses_no_error_feedback(monkeypatch):
    """Round 1 fails at unmasking (every unmask reply lost): the model stays, and round 2 must move it as
    a first round would at its own positions. On main the clients had committed round 1's residual, so
    round 2 re-sent round 1's update on top (2x the update at positions round 1 had not sent)."""
    monkeypatch.setattr(helpers, "RecordingGrid",
                        _fault_grid(lambda rnd, stage, pid: rnd == 1 and stage == Stage.UNMASK))
    models, strategy, workflow, _ = helpers.run_rounds(2, 4, 0.5)
    g = helpers.global_model()
    assert 1 not in strategy.history
    assert all(np.array_equal(models[1][k], g[k]) for k in g)
    proj, mean, w = _mean_update(range(4), 2)
    got = _model_delta(models[2], g)
    assert np.abs(got[proj.positions()] - mean).max() <= quantization_bound(w, 1.0, Q16) + 1e-6
    assert "too few unmasking shares" in workflow.round_skipped[1]


@pytest.mark.parametrize("stage", [Stage.SETUP, Stage.SHARE_KEYS])
def test_a_dropout_before_masking_does_not_fail_the_round(monkeypatch, stage):
    """One node drops at the setup or share-keys stage: on main Flower asked its neighbours for shares they
    never got and the whole round failed; now the round sums the other three."""
    monkeypatch.setattr(helpers, "RecordingGrid", _fault_grid(lambda rnd, st, pid: st == stage and pid == 0))
    new, strategy, workflow, _ = helpers.run_round(5, 0.5, threshold=0.6)
    assert strategy.history[1]["num-replies"] == 4 and workflow.round_skipped == {}
    proj, mean, w = _mean_update([1, 2, 3, 4], 1)
    got = _model_delta(new, helpers.global_model())
    assert np.abs(got[proj.positions()] - mean).max() <= quantization_bound(w, 1.0, Q16) + 1e-6


def _restarting_grid(restart_round):
    class G(helpers.RoundCountingGrid):
        def on_round(self, server_round):
            if server_round == restart_round:  # every SuperNode restarted: context.state is empty
                for ctx in self.contexts.values():
                    ctx.state = RecordDict()
    return G


def test_state_dir_keeps_the_residual_of_a_restarted_supernode(monkeypatch, tmp_path):
    cfgs = [{"state-dir": str(tmp_path)} for _ in range(3)]
    plain, *_ = helpers.run_rounds(2, 3, 0.5, node_configs=cfgs)
    monkeypatch.setattr(helpers, "RecordingGrid", _restarting_grid(2))
    restarted, *_ = helpers.run_rounds(2, 3, 0.5, node_configs=[{"state-dir": str(tmp_path / "b")}] * 3)
    assert sorted(p.name for p in (tmp_path / "b").iterdir() if p.name.startswith("secagg-residual-")
                  and ".prev" not in p.name) == [f"secagg-residual-{i}.npz" for i in range(3)]
    _, _, w = _mean_update(range(3), 2)
    bound = 2 * quantization_bound(w, 1.0, Q16)  # two rounds of independent rounding in each run
    g = helpers.global_model()
    assert np.abs(_model_delta(restarted[2], g) - _model_delta(plain[2], g)).max() <= 2 * bound + 1e-6


def test_without_a_state_dir_a_restart_starts_from_zero(monkeypatch):
    """The control of the test above: the figure it checks does move when the residual is lost."""
    plain, *_ = helpers.run_rounds(2, 3, 0.5)
    monkeypatch.setattr(helpers, "RecordingGrid", _restarting_grid(2))
    restarted, *_ = helpers.run_rounds(2, 3, 0.5)
    g = helpers.global_model()
    assert np.abs(_model_delta(restarted[2], g) - _model_delta(plain[2], g)).max() > 1e-3


@pytest.mark.parametrize("sampled", [0, 1])
def test_a_round_sampling_fewer_than_two_clients_is_skipped_not_the_run(sampled):
    _, strategy, workflow, _ = helpers.run_rounds(2, 3, 0.5, fraction_fit=0.0, min_fit_clients=sampled,
                                                       min_available_clients=1)
    assert workflow.round_skipped == {1: f"{sampled} client(s) sampled: SecAgg+ needs at least 2",
                                      2: f"{sampled} client(s) sampled: SecAgg+ needs at least 2"}
    assert strategy.history == {}


def test_a_node_joining_while_the_round_samples_does_not_overflow_the_auto_modulus(monkeypatch):
    """The client manager counts 2 nodes when first asked, then the sample holds 4: on main the modulus
    was sized for 2 and the run stopped with SecAggHalted."""
    from flwr.server.client_manager import SimpleClientManager
    real = SimpleClientManager.num_available
    calls = []

    def counting(self):
        calls.append(1)
        return 2 if len(calls) == 1 else real(self)

    monkeypatch.setattr(SimpleClientManager, "num_available", counting)
    _, strategy, workflow, _ = helpers.run_round(4, 0.5, min_available_clients=2, min_fit_clients=4)
    assert strategy.history[1]["num-replies"] == 4 and workflow.round_skipped == {}
    assert workflow.round_modulus_bits == 19  # ceil(log2(4 * 2**16 + 1)): sized from the sample


def test_pack_with_flowers_own_workflow_names_the_mismatch():
    from flwr.server.workflow import SecAggPlusWorkflow
    with pytest.raises(ValueError, match=r"pack=True\) needs fedcomp's CompressedSecAggPlusWorkflow"):
        helpers.run_round(3, 0.5, pack=True, workflow_cls=SecAggPlusWorkflow)


def test_pack_false_with_flowers_own_workflow_runs():
    from flwr.server.workflow import SecAggPlusWorkflow
    _, strategy, _, _ = helpers.run_round(3, 0.5, pack=False, workflow_cls=SecAggPlusWorkflow)
    assert strategy.history[1]["num-replies"] == 3


def test_clients_without_the_secure_mod_name_the_mismatch():
    from fedcomp.client import compression_mod
    _, strategy, workflow, _ = helpers.run_round(3, 0.5, mods=(compression_mod,))
    assert strategy.history == {}
    assert "secagg_mod" in workflow.round_skipped[1] and "no sampled node answered the SecAgg+ setup" in \
        workflow.round_skipped[1]


def test_dense_bytes_and_ratio_are_the_servers_own_figures(monkeypatch):
    class G(helpers.RecordingGrid):
        def send_and_receive(self, messages, *, timeout=None):
            out = list(super().send_and_receive(messages, timeout=timeout))
            for r in out:
                if not r.has_error() and "fitres.metrics" in r.content.config_records:
                    r.content.config_records["fitres.metrics"]["dense-bytes"] = 1e15  # a boastful client
            return out
    monkeypatch.setattr(helpers, "RecordingGrid", G)
    _, strategy, _, _ = helpers.run_round(3, 0.5)
    assert strategy.history[1]["dense-bytes"] == 4 * DIM * 3


def test_a_skipped_round_is_recorded_with_its_reason():
    from types import SimpleNamespace

    from fedcomp.app.secagg_server_app import SecAggRounds
    rounds = SecAggRounds.__new__(SecAggRounds)
    rounds.strategy = SimpleNamespace(history={})
    rounds.workflow = SimpleNamespace(round_skipped={3: "1 client(s) sampled: SecAgg+ needs at least 2"})
    assert rounds.round_fields(3, None) == {"skipped": "1 client(s) sampled: SecAgg+ needs at least 2"}
    assert rounds.round_fields(4, None) == {}
