"""Distributed DP under SecAgg+ (Skellam): the RDP bound, the noise shares, the accountant's
survivors, the CSPRNG noise and the run-config checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedcomp.privacy.client_level import ClientLevelDP
from fedcomp.privacy.distributed import (
    OVERFLOW_LIMIT,
    SKELLAM_ORDERS,
    DistributedDP,
    min_clipping_range,
    skellam_noise,
    skellam_rdp,
    skellam_tail,
)

Q16 = 1 << 16


def test_skellam_rdp_matches_hand_computed_values():
    # alpha D2^2 / (2 mu) + min(((2 alpha - 1) D2^2 + 6 D1) / (4 mu^2), 3 D1 / (2 mu))
    # mu = 10, D1 = 4, D2 = 2: alpha 2 -> 0.4 + min(36 / 400, 0.6) = 0.49; alpha 3 -> 0.6 + min(44 / 400, 0.6) = 0.71
    assert skellam_rdp([2, 3], 4.0, 2.0, 10.0) == pytest.approx([0.49, 0.71], abs=1e-12)
    # mu = 1: the second branch of the min wins: alpha 2 -> 4 + min(36 / 4, 6) = 10
    assert skellam_rdp([2], 4.0, 2.0, 1.0) == pytest.approx([10.0], abs=1e-12)


@pytest.mark.parametrize("bad", [{"orders": [1.5]}, {"orders": [1]}, {"variance": 0.0}, {"l1": -1.0}])
def test_skellam_rdp_refuses_bad_input(bad):
    args = {"orders": [2], "l1": 1.0, "l2": 1.0, "variance": 1.0, **bad}
    with pytest.raises(ValueError):
        skellam_rdp(args["orders"], args["l1"], args["l2"], args["variance"])


def test_sum_of_shares_is_skellam_of_the_intended_variance():
    ddp = DistributedDP(1.0, 1.0, 4.0, 1 << 10)  # step 2 ** -7: sum variance (z C / step)**2 = 16384
    t, n, k = 5, 5, 40_000
    gen = torch.Generator().manual_seed(0)
    total = sum(ddp.noise_share(k, t, gen).astype(np.float64) for _ in range(n))
    assert ddp.sum_variance == 16384.0 and ddp.share_variance(t) == 16384.0 / 5
    # sample variance of 40k draws: relative sd sqrt(2 / k) ~ 0.7 %, tolerance 4 % (> 5 sd)
    assert abs(total.var() / 16384.0 - 1) < 0.04
    assert abs(total.mean()) < 5 * math.sqrt(16384.0 / k)
    one = ddp.noise_share(k, t, gen)
    assert one.dtype == np.int64 and abs(one.var() / (16384.0 / 5) - 1) < 0.04


def test_skellam_noise_zero_variance_and_integer_values():
    gen = torch.Generator().manual_seed(1)
    assert torch.equal(skellam_noise((3,), 0.0, gen), torch.zeros(3, dtype=torch.int64))
    x = skellam_noise((1000,), 2.0, gen)
    assert x.dtype == torch.int64 and x.abs().max() < 20


def test_dropped_client_reduces_the_noise_and_raises_epsilon():
    full, dropped = (DistributedDP(1.0, 0.8, 5.0, Q16, 1e-5) for _ in range(2))
    a = full.record(1000, survivors=10, threshold=7)
    b = dropped.record(1000, survivors=8, threshold=7)
    assert a["dp-noise-std"] == pytest.approx(0.8 * math.sqrt(10 / 7), rel=1e-12)
    assert b["dp-noise-std"] == pytest.approx(0.8 * math.sqrt(8 / 7), rel=1e-12)
    assert b["dp-survivors"] == 8.0 and a["epsilon"] < b["epsilon"]
    # the Skellam bound's leading term is the Gaussian's at variance m V / t: epsilon of a Gaussian with
    # z * sqrt(m / t), plus less than 1 % for a 16-bit grid
    for info, m in ((a, 10), (b, 8)):
        gauss = ClientLevelDP(1.0, 0.8 * math.sqrt(m / 7), 1e-5).epsilon(1)
        assert gauss <= info["epsilon"] <= gauss * 1.01


def test_epsilon_composes_over_rounds_and_starts_at_zero():
    ddp = DistributedDP(1.0, 1.0, 5.0, Q16)
    assert ddp.epsilon() == 0.0
    eps = [ddp.record(100, 4, 4)["epsilon"] for _ in range(3)]
    assert eps[0] < eps[1] < eps[2]
    three = sum(DistributedDP(1.0, 1.0, 5.0, Q16).round_rdp(100, 4, 4) for _ in range(3))
    from fedcomp.privacy.accounting import epsilon_from_rdp

    assert eps[2] == pytest.approx(epsilon_from_rdp(SKELLAM_ORDERS, three, 1e-5), rel=1e-12)


def test_noise_share_is_not_reproducible_from_the_run_seed():
    ddp = DistributedDP(1.0, 1.0, 5.0, Q16)
    draws = []
    for _ in range(2):
        torch.manual_seed(42)
        np.random.seed(42)
        draws.append(ddp.noise_share(64, 3))
    assert not np.array_equal(draws[0], draws[1])


def test_overflow_bound_and_the_clipping_range_it_needs():
    c = min_clipping_range(1.0, 1.0, 7, Q16)
    assert 3.5 < c < 5.0  # about C + 8 std, std = z C / sqrt(7)
    DistributedDP(1.0, 1.0, c, Q16).check_range(7)
    with pytest.raises(ValueError, match="secagg-clipping-range' >= "):
        DistributedDP(1.0, 1.0, c * 0.9, Q16).check_range(7)
    assert DistributedDP(1.0, 1.0, c, Q16).overflow_probability(7) <= OVERFLOW_LIMIT
    assert DistributedDP(1.0, 1.0, c, Q16).min_threshold() <= 7
    assert DistributedDP(1.0, 0.6, 3.0, Q16).min_threshold() == 7  # min_clipping_range: 3.06 at t = 6, 2.91 at 7
    assert DistributedDP(1.0, 0.6, 4.6, Q16).min_threshold() == 2
    assert skellam_tail(10.0, 0.0) == 1.0 and skellam_tail(0.0, 1.0) == 0.0
    # Chernoff bound >= the exact tail: P(Sk(2) >= 3), by summing the Skellam pmf numerically
    gen = torch.Generator().manual_seed(3)
    emp = float((skellam_noise((200_000,), 2.0, gen) >= 3).double().mean())
    assert emp <= skellam_tail(2.0, 3.0)


@pytest.mark.parametrize("kw, match", [
    ({"clipping_range": 1.0}, "'secagg-clipping-range' = 1 must exceed 'clipping-norm'"),
    ({"noise_multiplier": 0.0}, "noise-multiplier"),
    ({"target_delta": 1.0}, "target-delta"),
])
def test_distributed_dp_refuses_bad_settings(kw, match):
    args = {"clipping_norm": 1.0, "noise_multiplier": 1.0, "clipping_range": 5.0, "quantization_range": Q16, **kw}
    with pytest.raises(ValueError, match=match):
        DistributedDP(**args)


def test_clip_bound_includes_the_rounding_slack():
    ddp = DistributedDP(1.0, 1.0, 4.0, Q16)
    assert ddp.clip_bound(10_000) == pytest.approx(1.0 - 100 * 8.0 / Q16)
    with pytest.raises(ValueError, match="secagg-quantization-bits"):
        DistributedDP(1.0, 1.0, 4.0, 1 << 8).clip_bound(10_000)


def test_dp_distributed_needs_secagg_naming_both_keys():
    from fedcomp.app.config import AppConfig
    from fedcomp.config.secagg import check_codec_under_secagg

    with pytest.raises(ValueError, match="dp = 'distributed' needs secagg = true"):
        AppConfig.from_run_config({"dp": "distributed"})
    cfg = AppConfig.from_run_config({"dp": "distributed", "secagg": True, "compressor": "randomk",
                                     "error-feedback": False})
    assert cfg.dp == "distributed"
    with pytest.raises(ValueError, match="needs error-feedback = false"):
        check_codec_under_secagg({"compressor": "randomk", "dp": "distributed"})
    check_codec_under_secagg({"compressor": "randomk", "dp": "distributed", "error-feedback": False})


def test_distributed_dp_at_its_defaults_stops_before_round_0_in_one_line(tmp_path):
    """Found by running each DP mode once: dp = 'distributed' with secagg = true and the default
    secagg-clipping-range (1, equal to the default clipping-norm) got past the start-up checks and
    crashed inside the SecAgg+ strategy's construction with a traceback (Flower exit code 700). It is
    now a RunConfigError (one line naming both keys) before anything starts or is written."""
    from flwr.app import Context, RecordDict

    from fedcomp.app.client_app import app as client_app
    from fedcomp.app.server_app import main
    from fedcomp.app.startup import RunConfigError
    from fedcomp.run.inprocess_grid import InProcessGrid

    results = tmp_path / "results"
    rc = {"num-server-rounds": 1, "dp": "distributed", "secagg": True, "error-feedback": False,
          "results-dir": str(results)}
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=rc)
    with pytest.raises(RunConfigError, match=r"'secagg-clipping-range' = 1 must exceed 'clipping-norm' = 1 "
                                             r"\(room for the noise shares; e\.g\. 6\.94 holds them"):
        main(InProcessGrid(client_app, 10, rc), ctx)
    assert not results.exists()


def test_a_setting_secagg_does_not_support_is_named_as_such(tmp_path):
    """Found by a new user: downstream-correction = 'on' with secagg = true was refused as 'the download
    is dense (downstream none)', a setting the user never set: the secure-aggregation checks now come
    first and name the key and secagg."""
    from flwr.app import Context, RecordDict

    from fedcomp.app.client_app import app as client_app
    from fedcomp.app.server_app import main
    from fedcomp.app.startup import RunConfigError
    from fedcomp.run.inprocess_grid import InProcessGrid

    rc = {"num-server-rounds": 1, "downstream-correction": "on", "secagg": True, "results-dir": str(tmp_path / "r")}
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=rc)
    with pytest.raises(RunConfigError, match=r"^run config 'downstream-correction' = 'on' is not supported with "
                                             r"secagg = true \(use 'off'\)$"):
        main(InProcessGrid(client_app, 10, rc), ctx)
