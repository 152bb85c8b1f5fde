"""Shared-seed random-k under Flower's SecAgg+, one in-process round: privacy of every reply,
the unmasked sum against the plain aggregate, dropouts, packing, error feedback."""

import numpy as np
import pytest

from fedcomp.secagg.encoding import SharedProjection, flower_weight, modulus_bits_for, quantization_bound, round_seed
from fedcomp.secagg.protocol_packing import unpack_masked
from fedcomp.secagg.residual import latest_residual

from .helpers import client_delta, global_model, num_examples, run_round

DIM = 2050
Q16 = 1 << 16


def _flat(d):
    return np.concatenate([d["w"].reshape(-1), d["b"].reshape(-1)]).astype(np.float64)


def _plain_aggregate(pids, density, rotation=False, scale=0.01):
    """Plain (non-secure) random-k aggregate of the same clients at the same shared positions, with
    SecAgg+'s FedAvg weights; and those weights."""
    proj = SharedProjection(DIM, density, round_seed(3, 1), rotation)
    w = [flower_weight(num_examples(p), 1000.0, Q16) for p in pids]
    vals = sum(wi * proj.encode(_flat(client_delta(p, scale)))[0] for p, wi in zip(pids, w)) / sum(w)
    return proj, vals, w


def _model_delta(new):
    g = global_model()
    return np.concatenate([(new["w"].astype(np.float64) - g["w"]).reshape(-1),
                           (new["b"].astype(np.float64) - g["b"]).reshape(-1)])


@pytest.mark.parametrize("rotation", [False, True])
def test_unmasked_sum_is_the_plain_randomk_aggregate_within_the_quantization_bound(rotation):
    n, density = 4, 0.25
    new, strategy, workflow, grid = run_round(n, density, rotation=rotation)
    proj, plain_vals, w = _plain_aggregate(range(n), density, rotation)
    got = _model_delta(new)
    bound = quantization_bound(w, 1.0, Q16)  # per entry, in the rotated domain
    fp32 = 2e-7 * np.abs(_flat(global_model())).max() + 1e-9  # the model is stored in float32
    if rotation:
        # the rotation is orthonormal: the error's L2 norm is at most sqrt(k) * bound
        err = np.linalg.norm(got - proj.decode(plain_vals))
        assert err <= np.sqrt(proj.k) * bound + np.sqrt(DIM) * fp32
    else:
        pos = proj.positions()
        assert np.abs(got[pos] - plain_vals).max() <= bound + fp32
        others = np.ones(DIM, bool)
        others[pos] = False
        assert np.abs(got[others]).max() <= fp32  # nothing moves outside the shared positions
    assert new["steps"] == 7 and new["steps"].dtype == np.int64  # integer buffers keep the global value
    assert new["w"].dtype == np.float32
    h = strategy.history[1]
    assert h["num-replies"] == n and h["failures"] == 0 and h["k"] == proj.k == 512 and h["clipped"] == 0
    # packed at the per-round modulus: ceil(log2(4 * 2**16 + 1)) = 19 bits, k values + the weight entry
    assert workflow.round_modulus_bits == modulus_bits_for(n, Q16) == 19
    head = 5 + 2 + 8  # magic, bits, ndim, one u64 dimension
    per_client = (head + 3) + (head + (512 * 19 + 7) // 8)  # the weight entry, then k values at 19 bits
    assert [sum(len(b) for b in grid.masked[p]) for p in range(n)] == [per_client] * n
    assert workflow.round_bytes["upload-bytes"] == n * per_client


def test_every_reply_is_uniform_modulo_the_modulus():
    """Chi-square of the top 4 bits of each client's masked values against uniform (p < 1e-6 fails);
    the same statistic on the unmasked quantized values is far above the threshold (the test has power)."""
    n, density = 3, 1.0
    _, _, workflow, grid = run_round(n, density, scale=0.05)
    bits = workflow.round_modulus_bits
    assert bits == modulus_bits_for(n, Q16) == 18
    threshold = 50.0  # chi-square, 15 degrees of freedom: P(X > 50) ~ 1e-5
    for pid in range(n):
        factor, values = (unpack_masked(b, bits) for b in grid.masked[pid])
        assert values.shape == (DIM,) and factor.shape == (1,)
        assert values.min() >= 0 and values.max() < 1 << bits
        counts = np.bincount(values >> (bits - 4), minlength=16)
        expected = DIM / 16
        assert ((counts - expected) ** 2 / expected).sum() < threshold, counts
        # what Flower would have masked: (w x + c) * Q / 2c, all in [0, Q] = the lowest quarter of [0, 2**18)
        w = flower_weight(num_examples(pid), 1000.0, Q16)
        plain = np.round((w * _flat(client_delta(pid, 0.05)) + 1.0) * Q16 / 2).astype(np.int64)
        plain_counts = np.bincount(plain >> (bits - 4), minlength=16)
        assert ((plain_counts - expected) ** 2 / expected).sum() > 100 * threshold


def test_a_client_dropping_after_sharing_keys_leaves_the_survivors_sum():
    n, density = 5, 0.5
    new, strategy, _workflow, _ = run_round(n, density, drop=[2])
    survivors = [0, 1, 3, 4]
    proj, plain_vals, w = _plain_aggregate(survivors, density)
    got = _model_delta(new)[proj.positions()]
    assert np.abs(got - plain_vals).max() <= quantization_bound(w, 1.0, Q16) + 1e-6
    _, with_all, _ = _plain_aggregate(range(n), density)
    assert np.abs(got - with_all).max() > 10 * quantization_bound(w, 1.0, Q16)  # the dropped client is not in it
    assert strategy.history[1]["num-replies"] == 4 and strategy.history[1]["failures"] == 1


def test_a_malformed_packed_vector_counts_as_a_dropout():
    n, density = 5, 0.5
    new, _strategy, workflow, _ = run_round(n, density, corrupt=[4])
    proj, plain_vals, w = _plain_aggregate([0, 1, 2, 3], density)
    assert np.abs(_model_delta(new)[proj.positions()] - plain_vals).max() <= quantization_bound(w, 1.0, Q16) + 1e-6
    assert workflow.round_bytes["malformed-replies"] == 1


def test_unpacked_int64_replies_and_error_feedback_residual():
    n, density = 3, 0.25
    new, _strategy, workflow, grid = run_round(n, density, pack=False)
    # Flower's own format: .npy int64, 8 bytes per value plus headers
    assert workflow.round_bytes["upload-bytes"] > n * 8 * 512
    proj, plain_vals, w = _plain_aggregate(range(n), density)
    assert np.abs(_model_delta(new)[proj.positions()] - plain_vals).max() <= quantization_bound(w, 1.0, Q16) + 1e-6
    # error feedback: the residual is the update minus what was sent (unsent entries exactly; sent ones
    # within one quantization step / weight)
    ctx = next(c for c in grid.contexts.values() if c.node_config["partition-id"] == 1)
    res = latest_residual(ctx)
    delta = _flat(client_delta(1))
    others = np.ones(DIM, bool)
    others[proj.positions()] = False
    np.testing.assert_allclose(res[others], delta[others], atol=1e-6)  # float32 residual
    assert np.abs(res[proj.positions()]).max() <= 2.0 / Q16 / w[1] + 1e-7


def test_clipping_is_kept_by_error_feedback():
    """Updates far beyond c: entries are clipped, the residual holds the excess (nothing lost)."""
    _new, strategy, _, grid = run_round(2, 1.0, scale=1.0, clipping_range=0.01)
    assert strategy.history[1]["clipped"] > 0
    ctx = next(iter(grid.contexts.values()))
    pid = ctx.node_config["partition-id"]
    w = flower_weight(num_examples(pid), 1000.0, Q16)
    res = latest_residual(ctx).astype(np.float64)
    sent = _flat(client_delta(pid, 1.0)) - res
    assert np.abs(sent).max() <= 0.01 / w + 1e-6  # what travelled is within +-c / w (float32 residual)


def test_fedavgm_inside_applies_the_same_aggregate_as_its_pseudo_gradient():
    """FedAvgM with server learning rate 1 and no momentum must land on FedAvg's model."""
    from flwr.server.strategy import FedAvgM

    avg, *_ = run_round(3, 0.25)
    avgm, *_ = run_round(3, 0.25, inner_cls=FedAvgM, server_learning_rate=1.0, server_momentum=0.0)
    proj, plain_vals, w = _plain_aggregate(range(3), 0.25)
    for new in (avg, avgm):
        assert np.abs(_model_delta(new)[proj.positions()] - plain_vals).max() <= quantization_bound(w, 1.0, Q16) + 1e-6
    assert avgm["w"].dtype == np.float32 and avgm["steps"] == 7


@pytest.mark.parametrize("server_lr", [1.0, 2.5])
def test_the_server_step_scales_the_decoded_mean_update(server_lr):
    """``secagg-server-lr``: the model moves by server_lr times the secure weighted mean, at the shared
    positions only (fails on main: SharedRandomKStrategy had no server_lr)."""
    new, strategy, *_ = run_round(3, 0.25, server_lr=server_lr)
    proj, plain_vals, w = _plain_aggregate(range(3), 0.25)
    got = _model_delta(new)
    pos = proj.positions()
    fp32 = 2e-7 * np.abs(_flat(global_model())).max() + 1e-9
    assert np.abs(got[pos] - server_lr * plain_vals).max() <= server_lr * quantization_bound(w, 1.0, Q16) + fp32
    assert 1.5 * np.abs(plain_vals).max() > 10 * 2.5 * quantization_bound(w, 1.0, Q16)  # steps 1 and 2.5 told apart
    others = np.ones(DIM, bool)
    others[pos] = False
    assert np.abs(got[others]).max() <= fp32
    assert strategy.server_lr == server_lr and ("server-lr=2.5" in strategy.describe()) == (server_lr == 2.5)


def test_the_decaying_server_step_falls_linearly_to_one_at_the_last_round():
    """``secagg-server-lr-decay``: 4 in round 1, 1 in round R, linear between (fails on main: no such step)."""
    from flwr.server.strategy import FedAvg

    from fedcomp.secagg import SharedRandomKStrategy

    s = SharedRandomKStrategy(FedAvg(), 0.25, server_lr=4.0, server_lr_rounds=5)
    assert [s.step(r) for r in range(8)] == [4.0, 4.0, 3.25, 2.5, 1.75, 1.0, 1.0, 1.0]
    assert "server-lr=4 falling to 1 at round 5" in s.describe()
    assert [SharedRandomKStrategy(FedAvg(), 0.25, server_lr=4.0, server_lr_rounds=r).step(3)
            for r in (0, 1)] == [4.0] * 2
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="server_lr_rounds must be an integer >= 0"):
            SharedRandomKStrategy(FedAvg(), 0.25, server_lr_rounds=bad)


def test_the_decaying_server_step_is_wired_from_the_run_config(tmp_path):
    """run config ``secagg-server-lr-decay = true`` -> the strategy decays over ``num-server-rounds``."""
    from flwr.app import Context, RecordDict

    from fedcomp.app.client_app import app as client_app
    from fedcomp.app.config import AppConfig
    from fedcomp.app.secagg_server_app import SecAggRounds, run_secagg
    from fedcomp.run.inprocess_grid import InProcessGrid

    seen = {}
    orig = SecAggRounds.round_fields

    def spy(self, server_round, recorder):
        seen[server_round] = self.strategy.step(server_round)
        return orig(self, server_round, recorder)

    rc = {"secagg": True, "num-server-rounds": 3, "secagg-server-lr": 3.0, "secagg-server-lr-decay": True,
          "secagg-threshold": 0.7}
    SecAggRounds.round_fields = spy
    try:
        run_secagg(InProcessGrid(client_app, 3, rc), Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                                            run_config=rc), AppConfig.from_run_config(rc), tmp_path)
    finally:
        SecAggRounds.round_fields = orig
    assert {r: v for r, v in seen.items() if r >= 1} == {1: 3.0, 2: 2.0, 3: 1.0}


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), True, "2"])
def test_a_server_step_that_is_not_a_positive_number_is_refused(bad):
    from flwr.server.strategy import FedAvg

    from fedcomp.secagg import SharedRandomKStrategy

    with pytest.raises(ValueError, match=r"'secagg-server-lr'\) must be a finite number > 0"):
        SharedRandomKStrategy(FedAvg(), 0.25, server_lr=bad)


@pytest.mark.parametrize("z", [0.0, 1.0])
def test_client_level_dp_clips_each_client_and_noises_the_sum(z):
    from fedcomp.privacy import ClientLevelDP

    n, density, clip = 3, 0.25, 0.05
    new, strategy, _, _ = run_round(n, density, ef=False, client_dp=ClientLevelDP(clip, z, 1e-5))
    proj = SharedProjection(DIM, density, round_seed(3, 1))
    bound_c = clip - np.sqrt(proj.k) * 2.0 / Q16  # uniform weight 1: the rounding slack is sqrt(k) steps
    clipped = []
    for p in range(n):
        v = proj.encode(_flat(client_delta(p)))[0]
        assert np.linalg.norm(v) > clip  # every client is clipped at this C
        clipped.append(v * bound_c / np.linalg.norm(v))
    expected = sum(clipped) / n  # divided by the clients sampled, not weighted by examples
    got = _model_delta(new)[proj.positions()]
    h = strategy.history[1]
    assert h["clipped-fraction"] == 1.0
    if z == 0:
        assert np.abs(got - expected).max() <= quantization_bound([1.0] * n, 1.0, Q16) + 1e-6
        assert h["epsilon"] == float("inf")
    else:
        std = float(np.std(got - expected))
        assert 0.85 * clip / n < std < 1.15 * clip / n  # noise std z * C / n over k = 512 entries
        assert 0 < h["epsilon"] < 50


def test_client_level_dp_refuses_error_feedback():
    from fedcomp.privacy import ClientLevelDP

    with pytest.raises(ValueError, match="needs error-feedback = false"):
        run_round(2, 0.25, ef=True, client_dp=ClientLevelDP(0.05, 1.0, 1e-5))


def test_serverapp_path_with_client_level_dp_writes_epsilon(tmp_path):
    """run_secagg (what `flwr run . --run-config "secagg=true ..."` calls) on fedcomp's real ClientApp, DP on."""
    import json

    from flwr.app import Context, RecordDict

    from fedcomp.app.client_app import app
    from fedcomp.app.config import AppConfig
    from fedcomp.app.secagg_server_app import run_secagg
    from fedcomp.run.inprocess_grid import InProcessGrid

    rc = {"num-server-rounds": 1, "secagg": True, "compressor": "randomk", "density": 0.0625, "dp": "client-level",
          "error-feedback": False, "clipping-norm": 0.5, "noise-multiplier": 0.8}
    ctx = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=rc)
    rounds = run_secagg(InProcessGrid(app, 2, rc), ctx, AppConfig.from_run_config(rc), tmp_path)
    data = json.loads((tmp_path / "metrics.json").read_text())
    assert data["privacy"]["mode"] == "client-level" and data["rounds"] == rounds
    r = rounds[1]
    assert r["num-replies"] == 2 and r["k"] == round(0.0625 * 38282) and 0 < r["epsilon"] < 100
    assert (tmp_path / "plot.png").exists()


@pytest.mark.parametrize("clip, replies", [(float("nan"), 0), (float("inf"), 0), (-1.0, 0), (0.0, 0), (0.05, 3)])
def test_a_clipping_norm_that_clips_nothing_is_refused_by_the_clients(clip, replies):
    """A server sending a NaN (or inf, <= 0) DP clipping norm made clients skip clipping and send their
    raw update (3 replies folded): now each client refuses the round and sends nothing."""
    from fedcomp.privacy import ClientLevelDP

    dp = ClientLevelDP(0.05, 1.0, 1e-5)
    dp.clipping_norm = clip  # what a hostile (or broken) server sends in the train config
    _, _, workflow, _ = run_round(3, 0.25, ef=False, client_dp=dp)
    assert (workflow.round_bytes["upload-bytes"] > 0) == (replies > 0)  # masked vectors that reached the server
