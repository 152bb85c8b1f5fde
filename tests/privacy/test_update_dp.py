"""Update-level DP: local clip+noise before compression, client-level DP-FedAvg on decoded updates
(ours and Flower's wrapper), RDP accounting, the max-epsilon stop, and start-up validation."""

import logging
import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg

import fedcomp.compression as fc
from fedcomp.client.update import compress_update
from fedcomp.app.config import AppConfig
from fedcomp.config import CodecConfig
from fedcomp.privacy import ClientLevelDP, LocalDP, clip_and_noise
from fedcomp.protocol.messages import MODEL_KEY
from fedcomp.strategies import CompressedStrategy, PoissonSampling, Privacy

logging.getLogger("flwr").setLevel(logging.WARNING)


def test_local_dp_noise_comes_before_selection_and_error_feedback():
    rng = np.random.default_rng(0)
    g = {"w": np.zeros(1000, np.float32)}
    t = {"w": (rng.standard_normal(1000) * 0.01).astype(np.float32)}
    codec = CodecConfig(compressor="topk", density=0.01)
    dp = LocalDP(clipping_norm=0.05, noise_multiplier=2.0)
    payloads, res, _ = compress_update(g, t, codec, {}, seed=7, local_dp=dp)
    sent = fc.decompress(payloads[MODEL_KEY])
    noisy = sent + torch.from_numpy(res[MODEL_KEY])  # v = clipped update + noise (what EF saw)
    # the payload is exactly top-k of the noisy update: positions chosen after the noise
    assert payloads[MODEL_KEY] == fc.get_compressor("topk", density=0.01).compress(noisy)
    clipped = clip_and_noise(torch.from_numpy(t["w"]), 0.05, 0.0)
    noise = noisy - clipped
    assert float(noise.std()) == pytest.approx(2.0 * 0.05, rel=0.1)
    clean_top = set(torch.topk(torch.from_numpy(t["w"]).abs(), 10).indices.tolist())
    assert set(torch.nonzero(sent).squeeze(1).tolist()) != clean_top


def test_local_dp_noise_cannot_be_regenerated_from_the_seeds_the_server_knows():
    """The noise seed is not a function of what the server knows (run seed, partition, round)."""
    g = {"w": np.zeros(500, np.float32)}
    t = {"w": np.full(500, 0.001, np.float32)}
    codec = CodecConfig(compressor="none", error_feedback=False)
    dp = LocalDP(clipping_norm=1.0, noise_multiplier=1.0)
    a = fc.decompress(compress_update(g, t, codec, {}, seed=7, local_dp=dp)[0]["w"])
    b = fc.decompress(compress_update(g, t, codec, {}, seed=7, local_dp=dp)[0]["w"])
    assert not torch.equal(a, b)  # same seed, same round: different noise (OS CSPRNG)
    for guess in (7, 0, 42):  # what the old code (or a server guessing seeds) would draw
        regenerated = clip_and_noise(torch.from_numpy(t["w"]), 1.0, 1.0, torch.Generator().manual_seed(guess))
        assert float((a - regenerated).abs().max()) > 0.1


def test_clip_and_noise_clips_to_the_norm():
    u = torch.full((100,), 1.0)
    assert float(torch.linalg.vector_norm(clip_and_noise(u, 2.0, 0.0))) == pytest.approx(2.0, rel=1e-6)
    small = torch.full((4,), 0.1)
    assert torch.equal(clip_and_noise(small, 2.0, 0.0), small)


def test_client_level_aggregate_clips_divides_by_sampled_and_adds_calibrated_noise():
    dp = ClientLevelDP(clipping_norm=1.0, noise_multiplier=0.0)
    a = np.full(100, 1.0, np.float32)  # norm 10 -> clipped to 1
    b = np.zeros(100, np.float32)
    b[0] = 0.5  # under the clip
    agg, info = dp.aggregate([a, b], clients=4)  # 4 sampled, 2 replied: divide by 4
    expect = (a / 10 + b) / 4
    assert np.allclose(agg, expect, atol=1e-7)
    assert info["clipped-fraction"] == 0.5 and info["max-update-norm"] == pytest.approx(10.0)
    noisy = ClientLevelDP(clipping_norm=2.0, noise_multiplier=1.5, seed=0)
    agg, _ = noisy.aggregate([np.zeros(200_000, np.float32)], clients=5)
    assert float(np.std(agg)) == pytest.approx(1.5 * 2.0 / 5, rel=0.01)


def test_rdp_epsilon_grows_with_rounds_and_is_inf_without_noise():
    dp = ClientLevelDP(clipping_norm=1.0, noise_multiplier=1.0, target_delta=1e-5)
    eps = [dp.epsilon(r) for r in (1, 2, 10, 50)]
    assert eps == sorted(eps) and eps[0] > 0
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    acc.history = [(1.0, 1.0, 10)]
    assert eps[2] == pytest.approx(acc.get_epsilon(1e-5))
    assert ClientLevelDP(1.0, 0.0).epsilon(3) == math.inf


@pytest.mark.parametrize("kw,key", [({"clipping_norm": 0.0, "noise_multiplier": 1.0}, "clipping-norm"),
                                    ({"clipping_norm": -1.0, "noise_multiplier": 1.0}, "clipping-norm"),
                                    ({"clipping_norm": 1.0, "noise_multiplier": -0.1}, "noise-multiplier"),
                                    ({"clipping_norm": 1.0, "noise_multiplier": 1.0, "target_delta": 1.0},
                                     "target-delta")])
def test_bad_dp_parameters_name_the_key(kw, key):
    with pytest.raises(ValueError, match=f"'{key}'"):
        ClientLevelDP(**kw)


@pytest.mark.parametrize("rc,key", [({"target-delta": 0.0}, "target-delta"), ({"target-delta": 1.5}, "target-delta"),
                                    ({"clipping-norm": 0.0}, "clipping-norm"), ({"noise-multiplier": -1.0},
                                                                                "noise-multiplier"),
                                    ({"dp": "central"}, "dp")])
def test_app_config_rejects_bad_dp_values(rc, key):
    with pytest.raises(ValueError, match=f"'{key}'"):
        AppConfig.from_run_config(rc)


def _run(strategy, rounds=2, nodes=3, run_config=None):
    from fedcomp.app.client_app import app as client_app
    from fedcomp.task.models import build_model
    from fedcomp.run.inprocess_grid import InProcessGrid

    grid = InProcessGrid(client_app, nodes, {"lr": 0.1, **(run_config or {})})
    start = ArrayRecord(build_model().state_dict())
    norms = []
    orig = strategy.aggregate_train

    def spy(rnd, replies):
        before = {k: v.copy() for k, v in strategy.sent_round.model.items()}
        arrays, m = orig(rnd, replies)
        if arrays is not None:
            norms.append(float(np.sqrt(sum(((arrays[k].numpy().astype(np.float64) - before[k]) ** 2).sum()
                                           for k in before))))
        return arrays, m

    strategy.aggregate_train = spy
    res = strategy.start(grid=grid, initial_arrays=start, num_rounds=rounds, train_config=ConfigRecord({"seed": 1}))
    return res, norms


@pytest.mark.parametrize("way", ["ours", "flower"])
def test_decoded_sign_updates_are_clipped_on_the_server_both_ways(way):
    """sign + error feedback: ||scale * sign|| = scale * sqrt(n) can be large; after server-side
    clipping of the decoded update the aggregate moves by at most the clipping norm (noise 0)."""
    clip = 0.05
    if way == "ours":
        s = CompressedStrategy(FedAvg(min_available_nodes=3, fraction_evaluate=0.0), compressor="sign",
                               privacy=Privacy(client_dp=ClientLevelDP(clip, 0.0)))
    else:
        s = CompressedStrategy(DifferentialPrivacyServerSideFixedClipping(
            FedAvg(min_available_nodes=3, fraction_evaluate=0.0), noise_multiplier=0.0, clipping_norm=clip,
            num_sampled_clients=3), compressor="sign")
    _, norms = _run(s)
    assert len(norms) == 2 and all(0 < n <= clip * (1 + 1e-5) for n in norms)
    if way == "ours":
        assert s.history[1]["clipped-fraction"] == 1.0 and s.history[1]["max-update-norm"] > clip
        assert s.history[2]["epsilon"] == math.inf


# epsilon depends on the noise multiplier alone; under local DP a small clipping norm keeps the noise (std 0.02)
# from blowing up local training (with std 2 a client's round-2 update was sometimes NaN)
@pytest.mark.parametrize("mode,dp,compressor", [
    ("client_dp", ClientLevelDP(clipping_norm=1.0, noise_multiplier=2.0), "stc"),
    ("local_dp", LocalDP(clipping_norm=0.01, noise_multiplier=2.0), "sign"),
], ids=["client-level", "local"])
def test_max_epsilon_stops_the_run_before_the_budget_is_exceeded(mode, dp, compressor):
    budget = (dp.epsilon(2) + dp.epsilon(3)) / 2  # round 3 would exceed it
    s = CompressedStrategy(FedAvg(min_available_nodes=2, fraction_evaluate=0.0), compressor=compressor,
                           privacy=Privacy(**{mode: dp}, max_epsilon=budget))
    _run(s, rounds=4, nodes=2)
    assert [s.history[r].get("num-replies", 0) for r in (1, 2, 3, 4)] == [2, 2, 0, 0]
    assert s.history[2]["epsilon"] <= budget < dp.epsilon(3)
    assert s.history[2]["epsilon"] == pytest.approx(dp.epsilon(2))
    assert "would raise epsilon" in s.stopped_reason


def _run_from_run_config(rc: dict, rounds: int):
    """The ServerApp's strategy for run config ``rc``, after ``rounds`` rounds on 2 in-process nodes."""
    from fedcomp.app.server_app import build_inner, concern_options

    cfg = AppConfig.from_run_config(rc)
    s = CompressedStrategy.from_codec_config(build_inner(cfg), cfg.codec, **concern_options(cfg))
    _run(s, rounds=rounds, nodes=2, run_config=rc)
    return s


def test_dp_sgd_epsilon_accumulates_across_rounds_in_the_federation():
    s = _run_from_run_config({"dp": "dp-sgd", "noise-multiplier": 1.0, "max-grad-norm": 1.0, "num-server-rounds": 3},
                             rounds=3)
    eps = [s.history[r]["epsilon-max"] for r in (1, 2, 3)]
    assert 0 < eps[0] < eps[1] < eps[2] < math.inf
    assert s.history[3]["epsilon-median"] <= eps[2]


def test_secure_rng_fails_fast_at_start_up():
    from types import SimpleNamespace

    from fedcomp.app.server_app import concern_options

    cfg = AppConfig.from_run_config({"dp": "dp-sgd"})
    with pytest.raises(ValueError, match="torchcsprng"):
        concern_options(cfg, SimpleNamespace(run_config={"dp": "dp-sgd", "secure-rng": True}))


@pytest.mark.parametrize("mode", ["local", "client-level"])
def test_serverapp_reports_epsilon_per_round_in_metrics_json(tmp_path, mode):
    import json

    from flwr.app import Context, RecordDict

    from fedcomp.app.client_app import app as client_app
    from fedcomp.app.server_app import main
    from fedcomp.run.inprocess_grid import InProcessGrid

    rc = {"num-server-rounds": 2, "dp": mode, "clipping-norm": 0.5, "noise-multiplier": 1.0,
          "results-dir": str(tmp_path), "compressor": "sign"}
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=rc)
    main(InProcessGrid(client_app, 2, rc), ctx)
    data = json.loads((tmp_path / "metrics.json").read_text())
    assert data["privacy"]["mode"] == mode and data["privacy"]["delta"] == 1e-5
    eps = [r["epsilon"] for r in data["rounds"][1:]]
    expect = [ClientLevelDP(0.5, 1.0).epsilon(r) for r in (1, 2)]
    assert eps == pytest.approx(expect)
    assert data["rounds"][2]["epsilon-round"] == pytest.approx(expect[1] - expect[0])
    assert (tmp_path / "plot.png").exists()


def test_dp_sgd_client_refuses_a_round_past_the_budget():
    s = _run_from_run_config({"dp": "dp-sgd", "noise-multiplier": 1.0, "num-server-rounds": 3, "max-epsilon": 0.5},
                             rounds=2)
    # the first round alone would exceed 0.5: every client refuses before touching its data
    assert s.history[1]["failed-clients"] == 2 and s.history[1]["num-replies"] == 0
    assert "every client refused round 1" in s.stopped_reason


def test_untrusted_epsilon_reports_are_sanitised():
    from fedcomp.strategies.round_metrics import reported_epsilon

    assert ([reported_epsilon(v) for v in (-1.0, float("nan"), "3", True, 2.5, math.inf)]
            == [None, None, None, None, 2.5, math.inf])


def test_poisson_client_sampling_amplifies_client_level_privacy():
    q = 0.5
    dp = ClientLevelDP(clipping_norm=1.0, noise_multiplier=1.0, sample_rate=q, seed=0)
    assert dp.epsilon(10) < ClientLevelDP(1.0, 1.0).epsilon(10)
    s = CompressedStrategy(FedAvg(min_available_nodes=4, min_train_nodes=1, fraction_evaluate=0.0),
                           compressor="sign", privacy=Privacy(client_dp=dp),
                           sampling=PoissonSampling(q, 3))
    counts = []
    orig = s.configure_train

    def spy(rnd, arrays, config, grid):
        msgs = orig(rnd, arrays, config, grid)
        counts.append((len(msgs), s.sent_round.sampled))
        return msgs

    s.configure_train = spy
    _run(s, rounds=6, nodes=4)
    assert all(expected == 2.0 for _, expected in counts)  # divisor: the expected count q * N
    assert len({n for n, _ in counts}) > 1  # the sampled count really varies round to round
    assert s.history[6]["epsilon"] == pytest.approx(dp.epsilon(dp.rounds))
