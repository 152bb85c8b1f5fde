"""Checkpoints written by earlier fedcomp versions (tests/server/fixtures/checkpoints) still load
and resume: weights, the inner strategy's optimizer state and the privacy accounting."""

import json
import pathlib
import shutil

import numpy as np
import pytest
from flwr.serverapp.strategy import FedAdam, FedAvg, FedAvgM

from fedcomp.privacy import ClientLevelDP, LocalDP
from fedcomp.app import checkpoint
from fedcomp.strategies import CompressedStrategy, Privacy

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "checkpoints"
RUNS = {
    "fedadam": {"strategy": "fedadam", "compressor": "stc", "density": 0.1, "model": "mlp", "server-lr": 0.01},
    "fedavg-client-level": {"strategy": "fedavg", "dp": "client-level", "compressor": "sign", "model": "mlp"},
    "fedavgm-local": {"strategy": "fedavgm", "dp": "local", "compressor": "stc", "density": 0.1, "model": "mlp"},
    "fedavg-resnet-8e2956f": {"strategy": "fedavg", "compressor": "stc", "density": 0.1, "model": "resnet"},
}


def _copy(tmp_path, name):
    d = tmp_path / name
    shutil.copytree(FIXTURES / name, d)
    return d


def test_an_old_fedadam_checkpoint_restores_the_optimizer_state(tmp_path):
    d = _copy(tmp_path, "fedadam")
    s = CompressedStrategy(FedAdam(), compressor="stc", density=0.1)
    rnd, weights, _ = checkpoint.load(d, s)
    assert rnd == 1 and list(weights) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    with np.load(d / checkpoint.WEIGHTS) as z:
        for k in weights:
            np.testing.assert_array_equal(s.inner.m_t[k], z[f"m_t/{k}"])
            np.testing.assert_array_equal(s.inner.v_t[k], z[f"v_t/{k}"])


def test_an_old_client_level_checkpoint_restores_the_rounds_counted(tmp_path):
    s = CompressedStrategy(FedAdam(), compressor="sign", privacy=Privacy(client_dp=ClientLevelDP(1.0, 1.0, 1e-5)))
    checkpoint.load(_copy(tmp_path, "fedavg-client-level"), s)
    assert s.client_dp.rounds == 1


def test_an_old_fedavgm_local_dp_checkpoint_restores_momentum_and_local_rounds(tmp_path):
    d = _copy(tmp_path, "fedavgm-local")
    s = CompressedStrategy(FedAvgM(), compressor="stc", density=0.1,
                           privacy=Privacy(local_dp=LocalDP(1.0, 1.0, 1e-5)))
    _, weights, _ = checkpoint.load(d, s)
    assert len(s.inner.momentum_vector) == len(weights)
    with np.load(d / checkpoint.WEIGHTS) as z:
        np.testing.assert_array_equal(s.inner.momentum_vector[0], z["momentum/0"])


def test_a_state_dict_checkpoint_restores_the_integer_rules_remainders(tmp_path):
    d = _copy(tmp_path, "fedavg-resnet-8e2956f")
    s = CompressedStrategy(FedAvg(), compressor="stc", density=0.1)
    rnd, weights, _ = checkpoint.load(d, s)
    bn_counters = [k for k in weights if k.endswith("num_batches_tracked")]
    assert rnd == 1 and len(bn_counters) == 9 and sorted(s.int_remainders) == sorted(bn_counters)
    with np.load(d / checkpoint.WEIGHTS) as z:
        for k in bn_counters:
            assert s.int_remainders[k].dtype == np.float64
            np.testing.assert_array_equal(s.int_remainders[k], z[f"int-remainder/{k}"])
            assert -0.5 <= float(s.int_remainders[k]) <= 0.5
        for k, w in weights.items():
            np.testing.assert_array_equal(w, z[f"w/{k}"])
            assert w.dtype == z[f"w/{k}"].dtype and w.shape == z[f"w/{k}"].shape


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if "resnet" in n else n
                                  for n in sorted(RUNS)])
def test_an_old_checkpoint_resumes_and_its_epsilon_continues(tmp_path, name, run_server_app):
    d = _copy(tmp_path, name)
    run_server_app({**RUNS[name], "seed": 3, "num-server-rounds": 2, "results-dir": str(d), "resume": True})
    rounds = json.loads((d / "metrics.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    dp = {"client-level": ClientLevelDP(1.0, 1.0, 1e-5), "local": LocalDP(1.0, 1.0, 1e-5)}.get(RUNS[name].get("dp"))
    if dp is not None:
        assert rounds[2]["epsilon"] == pytest.approx(dp.epsilon(2), rel=1e-9)  # round 2 counted after round 1
    assert json.loads((d / checkpoint.META).read_text())["round"] == 2


def test_the_privacy_budget_state_survives_a_checkpoint(tmp_path):
    s = CompressedStrategy(FedAdam(), compressor="sign", privacy=Privacy(max_epsilon=5.0))
    s.privacy.local_rounds, s.privacy.epsilon_next, s.privacy.epsilon_floor = 2, float("inf"), [1.0, 2.5]
    checkpoint.save(tmp_path, 2, {"w": np.zeros(3, np.float32)}, s, [{"round": 2}])
    back = CompressedStrategy(FedAdam(), compressor="sign", privacy=Privacy(max_epsilon=5.0))
    checkpoint.load(tmp_path, back)
    assert back.privacy.accounting() == s.privacy.accounting()
    assert back.privacy.exhausted(3) and "would raise epsilon to about inf" in back.stopped_reason


def test_a_codec_key_newer_than_the_checkpoint_counts_as_its_default():
    from fedcomp.app.config import AppConfig
    from fedcomp.app.server_app import check_same_codec

    saved = AppConfig.from_run_config({}).codec.to_mapping()
    newest = sorted(saved)[0]
    del saved[newest]  # a checkpoint written before that key existed
    check_same_codec(saved, AppConfig.from_run_config({}))
    with pytest.raises(ValueError, match="'density' = 0.5 \\(checkpoint: 0.01\\)"):
        check_same_codec(saved, AppConfig.from_run_config({"density": 0.5}))


def test_a_checkpoint_with_the_old_batchnorm_default_resumes_under_auto():
    """Checkpoints that hold ``batchnorm-stats = "small"`` (the fixture checkpoints do) resume under "auto"."""
    from fedcomp.app.config import AppConfig
    from fedcomp.app.server_app import check_same_codec

    saved = AppConfig.from_run_config({}).codec.to_mapping()
    assert saved["batchnorm-stats"] == "auto"
    check_same_codec({**saved, "batchnorm-stats": "small"}, AppConfig.from_run_config({}))
    with pytest.raises(ValueError, match="'batchnorm-stats' = 'small' \\(checkpoint: 'auto'\\)"):
        check_same_codec(saved, AppConfig.from_run_config({"batchnorm-stats": "small"}))
