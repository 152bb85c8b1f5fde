"""dp = 'distributed' through a real SecAgg+ round: the clients' Skellam shares are in the unmasked
sum, the server adds nothing, and a dropout lowers the noise the accountant charges."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedcomp.privacy.distributed import DistributedDP
from fedcomp.secagg.encoding import SharedProjection, add_noise_share, round_seed

from .helpers import client_delta, global_model, run_round

Q16 = 1 << 16
DIM = 2050


def _flat(d):
    return np.concatenate([d["w"].reshape(-1), d["b"].reshape(-1)]).astype(np.float64)


def _delta(new):
    g = global_model()
    return _flat({k: new[k].astype(np.float64) - g[k].astype(np.float64) for k in ("w", "b")})


@pytest.mark.parametrize("drop", [(), (3,)])
def test_distributed_dp_round_sums_the_survivors_noise(drop):
    n, density, clip, z = 4, 0.25, 0.05, 1.0
    ddp = DistributedDP(clip, z, 1.0, Q16, 1e-5)
    new, strategy, workflow, _ = run_round(n, density, ef=False, distributed_dp=ddp, drop=drop)
    proj = SharedProjection(DIM, density, round_seed(3, 1))
    bound = clip - math.sqrt(proj.k) * 2.0 / Q16
    survivors = [p for p in range(n) if p not in drop]
    clipped = []
    for p in survivors:
        v = proj.encode(_flat(client_delta(p)))[0]
        clipped.append(v * min(1.0, bound / np.linalg.norm(v)))
    expected = sum(clipped) / n  # divided by the clients sampled
    noise = _delta(new)[proj.positions()] - expected
    h = strategy.history[1]
    t = strategy.round_threshold
    assert t == 3  # threshold 0.6 of 4 shares, raised to a majority
    want = z * clip * math.sqrt(len(survivors) / t) / n  # the survivors' shares, over the clients sampled
    assert h["dp-survivors"] == len(survivors)
    assert h["dp-noise-std"] == pytest.approx(want * n, rel=1e-12)
    assert 0.85 * want < float(np.std(noise)) < 1.15 * want  # k = 512 entries
    assert abs(float(np.mean(noise))) < 4 * want / math.sqrt(proj.k)
    assert 0 < h["epsilon"] < 100 and h["clipped-fraction"] == 1.0


def test_a_dropout_raises_epsilon():
    eps = {}
    for drop in ((), (3,)):
        ddp = DistributedDP(0.05, 1.0, 1.0, Q16, 1e-5)
        _, strategy, _, _ = run_round(4, 0.25, ef=False, distributed_dp=ddp, drop=drop)
        eps[drop] = strategy.history[1]["epsilon"]
    assert eps[()] < eps[(3,)]


def test_distributed_dp_needs_the_compressed_workflow_and_no_error_feedback():
    from flwr.server.workflow import SecAggPlusWorkflow

    with pytest.raises(ValueError, match="needs error-feedback = false"):
        run_round(2, 0.25, ef=True, distributed_dp=DistributedDP(0.05, 1.0, 1.0, Q16))
    with pytest.raises(ValueError, match="CompressedSecAggPlusWorkflow"):
        run_round(3, 0.25, ef=False, pack=False, distributed_dp=DistributedDP(0.05, 1.0, 1.0, Q16),
                  workflow_cls=SecAggPlusWorkflow)


def test_noise_share_stays_on_the_grid_and_refuses_overflow():
    import torch

    ddp = DistributedDP(0.05, 1.0, 1.0, Q16)
    step = 2.0 / Q16
    sent = (np.arange(-100, 100) * step)
    out = add_noise_share(sent, ddp, sent.size, 3, torch.Generator().manual_seed(0))
    j = (out + 1.0) / step
    assert np.allclose(j, np.rint(j), atol=1e-6) and not np.allclose(out, sent)
    tight = DistributedDP(0.05, 1.0, 0.06, Q16)  # c barely above C: the noise leaves [-c, c]
    with pytest.raises(ValueError, match="left secagg-clipping-range"):
        add_noise_share(np.full(1000, 0.05), tight, 1000, 3, torch.Generator().manual_seed(0))


def test_serverapp_path_with_distributed_dp_writes_epsilon(tmp_path):
    import json

    from flwr.app import Context, RecordDict

    from fedcomp.app.client_app import app
    from fedcomp.app.secagg_server_app import run_secagg
    from fedcomp.app.config import AppConfig
    from fedcomp.run.inprocess_grid import InProcessGrid

    rc = {"num-server-rounds": 2, "secagg": True, "compressor": "randomk", "density": 0.0625, "dp": "distributed",
          "error-feedback": False, "clipping-norm": 0.5, "noise-multiplier": 0.8, "secagg-clipping-range": 4.0}
    ctx = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=rc)
    rounds = run_secagg(InProcessGrid(app, 3, rc), ctx, AppConfig.from_run_config(rc), tmp_path)
    data = json.loads((tmp_path / "metrics.json").read_text())
    assert data["privacy"]["mode"] == "distributed" and data["rounds"] == rounds
    r1, r2 = rounds[1], rounds[2]
    assert r1["num-replies"] == 3 and r1["dp-survivors"] == 3 and 0 < r1["epsilon"] < r2["epsilon"] < 100
    assert r2["epsilon-round"] == pytest.approx(r2["epsilon"] - r1["epsilon"])


@pytest.mark.parametrize("server_z, replies", [(None, 3), (0.5, 3), (1.0, 4)], ids=["no-ddp", "less-noise", "enough"])
def test_a_node_with_its_own_distributed_dp_floor_refuses_less_noise(server_z, replies, caplog):
    import logging

    caplog.set_level(logging.ERROR, logger="flwr")
    node = {"dp": "distributed", "noise-multiplier": 1.0}
    kw = {} if server_z is None else {"distributed_dp": DistributedDP(0.05, server_z, 1.0, Q16)}
    _, strategy, _, _ = run_round(4, 0.25, ef=False, node_configs=[node, {}, {}, {}], **kw)
    assert strategy.history[1]["num-replies"] == replies
    refused = [r for r in caplog.records if "dp = 'distributed' with noise-multiplier 1.0" in r.getMessage()]
    assert bool(refused) == (replies == 3)


@pytest.mark.parametrize("dp", ["distributed", "client-level"])
def test_max_epsilon_stops_the_secure_path(tmp_path, dp):
    """max-epsilon was ignored under SecAgg+: the run went on past the budget. Now a round that could
    raise epsilon past it samples nobody, and the run's results say why it stopped."""
    import json

    from flwr.app import Context, RecordDict

    from fedcomp.app.client_app import app
    from fedcomp.app.secagg_server_app import run_secagg
    from fedcomp.app.config import AppConfig
    from fedcomp.run.inprocess_grid import InProcessGrid

    rc = {"num-server-rounds": 4, "secagg": True, "compressor": "randomk", "density": 0.0625, "dp": dp,
          "error-feedback": False, "clipping-norm": 0.5, "noise-multiplier": 0.8, "secagg-clipping-range": 4.0}
    ctx = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=rc)
    (tmp_path / "free").mkdir()
    (tmp_path / "capped").mkdir()
    free = run_secagg(InProcessGrid(app, 3, rc), ctx, AppConfig.from_run_config(rc), tmp_path / "free")
    eps = [free[r]["epsilon"] for r in (1, 2, 3, 4)]
    assert eps == sorted(eps) and eps[0] > 0
    budget = (eps[1] + eps[2]) / 2  # two rounds fit, the third would not
    rc = {**rc, "max-epsilon": budget}
    ctx = Context(run_id=2, node_id=0, node_config={}, state=RecordDict(), run_config=rc)
    rounds = run_secagg(InProcessGrid(app, 3, rc), ctx, AppConfig.from_run_config(rc), tmp_path / "capped")
    data = json.loads((tmp_path / "capped" / "metrics.json").read_text())
    trained = [r for r in rounds if r.get("num-replies")]
    # client-level DP projects exactly; distributed DP projects the fewest survivors' (least) noise, so it
    # may stop a round earlier than the rounds that ran with more survivors would have needed
    want = [1, 2] if dp == "client-level" else [[1], [1, 2]]
    got = [r["round"] for r in trained]
    assert (got == want) if dp == "client-level" else (got in want)
    assert max(r["epsilon"] for r in trained) <= budget
    assert data["stopped"].startswith(f"privacy budget: round {len(got) + 1} would raise epsilon to about ")
    assert f"max-epsilon {budget:g}" in data["stopped"]


@pytest.mark.parametrize("clip", [None, 0.0, float("nan"), "0.05"], ids=["no-clip", "zero", "nan", "str"])
def test_a_node_floor_is_not_passed_by_a_noise_multiplier_without_a_clipping_norm(clip):
    """The client adds its noise share only with both keys: a server that sends a high enough noise
    multiplier but no valid clipping norm (so the client would clip nothing and add no noise) is refused."""
    from flwr.app import Context, RecordDict

    from fedcomp.protocol.messages import SECAGG_DDP_NOISE_KEY, SECAGG_DP_CLIP_KEY
    from fedcomp.secagg.client import check_node_floor

    ctx = Context(run_id=1, node_id=5, node_config={"dp": "distributed", "noise-multiplier": 1.0}, state=RecordDict(),
                  run_config={})
    cfg = {SECAGG_DDP_NOISE_KEY: 2.0, "density": 0.25} | ({} if clip is None else {SECAGG_DP_CLIP_KEY: clip})
    with pytest.raises(ValueError, match="refuses the secure round: its config sets dp = 'distributed'"):
        check_node_floor(ctx, cfg)
    check_node_floor(ctx, {**cfg, SECAGG_DP_CLIP_KEY: 0.05})  # both: accepted


def test_a_refused_round_whose_noised_sum_was_unmasked_is_still_charged(monkeypatch):
    """Under distributed DP the server is the adversary: a round refused after SecAgg+ unmasked its sum
    (here a client masked another weight than it reported) still gave the server one noised sum, so
    the accountant counts it (the next round's epsilon is that of two releases)."""
    from . import helpers
    from .test_secagg_curious_server import _reweighting_grid

    honest = DistributedDP(0.05, 1.0, 1.0, Q16, 1e-5)
    _, strategy, _, _ = run_round(4, 0.25, ef=False, distributed_dp=honest)
    monkeypatch.setattr(helpers, "RecordingGrid", _reweighting_grid(3))
    ddp = DistributedDP(0.05, 1.0, 1.0, Q16, 1e-5)
    _, strategy, workflow, _ = helpers.run_round(4, 0.25, ef=False, distributed_dp=ddp)
    assert 1 not in strategy.history and "unmasked weight sum" in workflow.round_skipped[1]
    assert ddp.rounds == 1 and ddp.epsilon() == honest.epsilon()  # same k, 4 survivors, threshold 3


def test_distributed_dp_clients_refuse_a_weight_other_than_one():
    """The noise shares are integers on SecAgg+'s grid only at weight 1: with a fractional max_weight
    (here 1000.5, set by the server in the SecAgg+ setup) Flower would scale each client's noisy
    values and re-round them one by one, so the server would not see just the noised sum. Every
    client refuses (the round is skipped); the run config is refused at start-up."""
    from fedcomp.config.secagg import check_codec_under_secagg
    from fedcomp.secagg import CompressedSecAggPlusWorkflow

    def fractional(*args, **kw):
        return CompressedSecAggPlusWorkflow(*args, **{**kw, "max_weight": 1000.5})

    ddp = DistributedDP(0.05, 1.0, 1.0, Q16, 1e-5)
    _, strategy, workflow, _ = run_round(4, 0.25, ef=False, distributed_dp=ddp, workflow_cls=fractional)
    assert 1 not in strategy.history and ddp.rounds == 0 and 1 in workflow.round_skipped
    rc = {"secagg": True, "compressor": "randomk", "dp": "distributed", "error-feedback": False}
    with pytest.raises(ValueError, match="'secagg-max-weight' = 1000.5"):
        check_codec_under_secagg({**rc, "secagg-max-weight": 1000.5})
    check_codec_under_secagg({**rc, "secagg-max-weight": 1000.0})


def test_a_budget_or_clipping_norm_past_float_range_is_refused_with_a_clear_error():
    """An int budget past float range raised OverflowError ('int too large to convert to
    float') from math.isfinite, naming no setting; the client's clipping-norm check did the same."""
    from fedcomp.privacy.accounting import checked_max_epsilon
    from fedcomp.secagg.client import _positive_number
    from fedcomp.secagg.strategy import SharedRandomKStrategy

    with pytest.raises(ValueError, match="max-epsilon"):
        checked_max_epsilon(10**400)
    with pytest.raises(ValueError, match="max-epsilon"):
        SharedRandomKStrategy(None, 0.25, max_epsilon=10**400)
    assert checked_max_epsilon(1e308) == 1e308 and checked_max_epsilon(3) == 3.0
    assert [_positive_number(v) for v in (10**400, 1e308, 5, 0.05)] == [False, True, True, True]
