"""Sample-level DP-SGD on the client (fedcomp.privacy.dp_sgd): accounting across rounds,
no double wrapping, exact micro-batch accumulation, config validation, calibration."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from opacus import GradSampleModule
from opacus.accountants import RDPAccountant
from torch import nn
from torch.utils.data import TensorDataset

from fedcomp import privacy
from fedcomp.privacy.dp_sgd import train_dp_sgd
from fedcomp.privacy import (
    DPSGDConfig,
    accountant_state,
    calibrate_noise_multiplier,
    epsilon_spent,
    restore_accountant,
)

CPU = torch.device("cpu")


def make_data(n: int, seed: int = 0, features: int = 6, classes: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g))


def tiny_mlp(seed: int = 0, inplace: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=inplace), nn.Linear(8, 3))


BATCH_SIZES: list[int] = []


class Recorder(nn.Module):
    """Tiny MLP that records the batch size of each forward pass (module-level list, so the
    private copy made by train_dp_sgd records into the same list)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        BATCH_SIZES.append(int(x.shape[0]))
        return self.fc2(torch.tanh(self.fc1(x)))


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --- accounting across rounds -----------------------------------------------------------------

def test_epsilon_grows_when_state_is_carried_and_restarts_without_it():
    data = make_data(64)
    tc = dict(local_epochs=1, batch_size=8, accumulation_steps=2, lr=0.05, momentum=0.9)
    dc = DPSGDConfig(noise_multiplier=1.0, max_grad_norm=1.0, target_delta=1e-5)
    model = tiny_mlp()
    _, n, eps1, st1 = train_dp_sgd(model, data, dc, CPU, **tc, seed=1, accountant_state=None)
    _, _, eps2, st2 = train_dp_sgd(model, data, dc, CPU, **tc, seed=2, accountant_state=st1)
    _, _, eps3, st3 = train_dp_sgd(model, data, dc, CPU, **tc, seed=3, accountant_state=st2)
    _, _, eps_fresh, st_fresh = train_dp_sgd(model, data, dc, CPU, **tc, seed=4, accountant_state=None)
    assert n == 64
    assert 0 < eps1 < eps2 < eps3 < math.inf
    assert eps_fresh == pytest.approx(eps1, rel=1e-12)  # a fresh state restarts the budget
    # q = 16/64 = 0.25, ceil(64/16) = 4 steps per round, history merged into one segment
    assert st1 == {"noise-multiplier": [1.0], "sample-rate": [0.25], "steps": [4.0]}
    assert st3 == {"noise-multiplier": [1.0], "sample-rate": [0.25], "steps": [12.0]}
    assert st_fresh == st1
    # independent check against Opacus' own RDP accountant on the same history
    ref = RDPAccountant()
    ref.history = [(1.0, 0.25, 12)]
    assert eps3 == pytest.approx(ref.get_epsilon(delta=1e-5), rel=1e-9)


def test_accountant_records_sample_rate_logical_batch_over_n():
    data = make_data(100)
    tc = dict(local_epochs=2, batch_size=8, accumulation_steps=2, lr=0.05, momentum=0.0)
    _, _, eps, st = train_dp_sgd(tiny_mlp(), data, DPSGDConfig(noise_multiplier=0.8), CPU, **tc, seed=0)
    # logical batch 16, N = 100: q = 0.16 (not 1/ceil(100/16) = 1/7), 7 steps/epoch x 2 epochs
    assert st["sample-rate"] == [0.16]
    assert st["steps"] == [14.0]
    assert st["noise-multiplier"] == [0.8]
    assert restore_accountant("rdp", st).history == [(0.8, 0.16, 14)]
    assert epsilon_spent(restore_accountant("rdp", st), 1e-5) == pytest.approx(eps)


def test_state_is_a_valid_metric_record_and_bad_state_is_rejected():
    from flwr.app import MetricRecord, RecordDict

    acc = restore_accountant("rdp", {"noise-multiplier": [1.0, 2.0], "sample-rate": [0.1, 0.1], "steps": [3.0, 5.0]})
    state = accountant_state(acc)
    rd = RecordDict({"dp-accountant": MetricRecord(state)})  # how the ClientApp keeps it
    back = restore_accountant("prv", dict(rd["dp-accountant"]))  # same history serves "prv"
    assert back.history == [(1.0, 0.1, 3), (2.0, 0.1, 5)]
    assert accountant_state(restore_accountant("rdp", None)) == {"noise-multiplier": [], "sample-rate": [], "steps": []}
    for bad in ({"noise-multiplier": [1.0], "sample-rate": [0.1]},
                {"noise-multiplier": [1.0], "sample-rate": [0.1, 0.2], "steps": [1.0]},
                {"noise-multiplier": [1.0], "sample-rate": [1.5], "steps": [1.0]},
                {"noise-multiplier": [1.0], "sample-rate": [0.1], "steps": [1.5]}):
        with pytest.raises(ValueError):
            restore_accountant("rdp", bad)


def test_prv_accountant_carries_state_and_is_tighter_than_rdp():
    data = make_data(32)
    tc = dict(local_epochs=1, batch_size=8, accumulation_steps=1, lr=0.05, momentum=0.0)
    dc = DPSGDConfig(noise_multiplier=1.0, accountant="prv")
    _, _, eps1, st1 = train_dp_sgd(tiny_mlp(), data, dc, CPU, **tc, seed=0)
    _, _, eps2, st2 = train_dp_sgd(tiny_mlp(), data, dc, CPU, **tc, seed=1, accountant_state=st1)
    assert 0 < eps1 < eps2
    assert st2["steps"] == [8.0]
    assert eps2 < epsilon_spent(restore_accountant("rdp", st2), 1e-5)


def test_zero_noise_reports_infinite_epsilon():
    data = make_data(32)
    tc = dict(local_epochs=1, batch_size=8, accumulation_steps=1, lr=0.05, momentum=0.0)
    _, _, eps, st = train_dp_sgd(tiny_mlp(), data, DPSGDConfig(noise_multiplier=0.0), CPU, **tc, seed=0)
    assert eps == float("inf")
    # once a noiseless step is in the history, the run never has a finite epsilon again
    _, _, eps2, _ = train_dp_sgd(tiny_mlp(), data, DPSGDConfig(noise_multiplier=1.0), CPU, **tc, seed=1,
                                 accountant_state=st)
    assert eps2 == float("inf")
    assert epsilon_spent(restore_accountant("rdp", None), 1e-5) == 0.0


# --- model handling ---------------------------------------------------------------------------

def _assert_plain(model: nn.Module) -> None:
    for sub in model.modules():
        assert not sub._forward_hooks and not sub._forward_pre_hooks and not sub._backward_hooks
    for p in model.parameters():
        assert not hasattr(p, "grad_sample") and not hasattr(p, "summed_grad")


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_training_twice_on_the_same_model_never_wraps_it_and_keeps_original_keys():
    model = tiny_mlp()
    keys = list(model.state_dict())
    before = params_of(model)
    data = make_data(48)
    tc = dict(local_epochs=1, batch_size=8, accumulation_steps=2, lr=0.1, momentum=0.9)
    st = None
    for seed in range(3):
        _, _, _, st = train_dp_sgd(model, data, DPSGDConfig(), CPU, **tc, seed=seed, accountant_state=st)
        assert type(model) is nn.Sequential
        assert list(model.state_dict()) == keys  # no "_module." prefix
        _assert_plain(model)
    after = params_of(model)
    assert any(not torch.equal(before[k], after[k]) for k in keys)
    # An already-wrapped model is unwrapped, not wrapped again; trained weights go into it.
    wrapped = GradSampleModule(tiny_mlp(seed=3))
    inner_before = params_of(wrapped._module)
    train_dp_sgd(wrapped, data, DPSGDConfig(), CPU, **tc, seed=0)
    assert list(wrapped._module.state_dict()) == keys
    assert any(not torch.equal(inner_before[k], v) for k, v in wrapped._module.state_dict().items())
    x, y = data.tensors
    nn.functional.cross_entropy(wrapped(x[:4]), y[:4]).backward()  # the caller's wrapper still works
    assert wrapped._module[0].weight.grad_sample.shape == (4, 8, 6)


def test_inplace_activation_is_replaced_in_the_copy_only():
    model = tiny_mlp(inplace=True)
    data = make_data(32)
    tc = dict(local_epochs=1, batch_size=8, accumulation_steps=1, lr=0.1, momentum=0.0)
    loss, _, _, _ = train_dp_sgd(model, data, DPSGDConfig(), CPU, **tc, seed=0)
    assert math.isfinite(loss)
    assert model[1].inplace is True  # caller's module untouched
    _assert_plain(model)


def test_batchnorm_is_refused_with_opacus_message_and_the_model_is_untouched():
    """BatchNorm used to be replaced by GroupNorm for training while the model kept BatchNorm with
    running statistics never updated; now DP-SGD refuses it with Opacus' explanation."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(inplace=True), nn.Linear(8, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tc = dict(local_epochs=1, batch_size=8, accumulation_steps=1, lr=0.1, momentum=0.0)
    with pytest.raises(ValueError, match="BatchNorm cannot support training with differential privacy"):
        train_dp_sgd(model, make_data(32), DPSGDConfig(), CPU, **tc, seed=0)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_microbatch_accumulation_equals_one_large_batch_gradient():
    """Noise 0 and a huge clipping norm: DP-SGD's step over 3 micro-batches of 8 is exactly
    the plain full-batch mean-gradient step (logical batch = N = 24, so q = 1)."""
    data = make_data(24, seed=5)
    model = Recorder()
    ref = copy.deepcopy(model)
    theta0 = params_of(model)
    lr = 1.0
    tc = dict(local_epochs=1, batch_size=8, accumulation_steps=3, lr=lr, momentum=0.0)
    dc = DPSGDConfig(noise_multiplier=0.0, max_grad_norm=1e6)
    BATCH_SIZES.clear()
    _, _, _, st = train_dp_sgd(model, data, dc, CPU, **tc, seed=0)
    assert BATCH_SIZES == [8, 8, 8]  # one logical step made of three physical micro-batches
    assert st["sample-rate"] == [1.0] and st["steps"] == [1.0]
    x, y = data.tensors
    nn.functional.cross_entropy(ref(x), y).backward()
    for name, p in ref.named_parameters():
        dp_grad = (theta0[name] - model.state_dict()[name]) / lr
        torch.testing.assert_close(dp_grad, p.grad, atol=1e-5, rtol=1e-5)


def test_empty_poisson_batches_still_step_and_stay_finite():
    data = make_data(5)
    tc = dict(local_epochs=2, batch_size=1, accumulation_steps=1, lr=0.1, momentum=0.9)
    model = Recorder()
    BATCH_SIZES.clear()
    loss, _, eps, st = train_dp_sgd(model, data, DPSGDConfig(noise_multiplier=1.0), CPU, **tc, seed=3)
    assert 0 in BATCH_SIZES  # q = 0.2 over 5 examples: some logical batches are empty
    assert st["steps"] == [10.0]  # ... and still count as (noise-only) steps
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    assert math.isfinite(loss) and math.isfinite(eps)


# --- configuration ----------------------------------------------------------------------------

def test_from_mapping_reads_kebab_case_keys():
    cfg = DPSGDConfig.from_mapping({
        "noise-multiplier": 0.7, "max-grad-norm": 2, "target-delta": 1e-6, "accountant": "prv",
        "secure-rng": False, "lr": 0.1,
    })
    assert cfg == DPSGDConfig(noise_multiplier=0.7, max_grad_norm=2.0, target_delta=1e-6, accountant="prv")
    cal = DPSGDConfig.from_mapping({"target-epsilon": 3, "num-server-rounds": 20})
    assert cal.target_epsilon == 3.0 and cal.planned_rounds == 20
    assert DPSGDConfig.from_mapping({}) == DPSGDConfig()


@pytest.mark.parametrize("cfg, key", [
    ({"target-delta": 0.0}, "target-delta"),
    ({"target-delta": 1.0}, "target-delta"),
    ({"target-delta": -1e-5}, "target-delta"),
    ({"max-grad-norm": 0.0}, "max-grad-norm"),
    ({"max-grad-norm": -1.0}, "max-grad-norm"),
    ({"noise-multiplier": -0.1}, "noise-multiplier"),
    ({"noise-multiplier": "1.0"}, "noise-multiplier"),
    ({"target-epsilon": -1.0}, "target-epsilon"),  # 0 means "not set" (the run config needs a default)
    ({"target-epsilon": 0.01}, "target-epsilon"),  # below what any noise reaches with RDP at 1e-5
    ({"target-epsilon": 1.0, "num-server-rounds": 0}, "num-server-rounds"),
    ({"accountant": "gdp"}, "accountant"),
    ({"secure-rng": "yes"}, "secure-rng"),
])
def test_bad_config_raises_value_error_naming_the_key(cfg, key):
    with pytest.raises(ValueError, match=f"'{key}'"):
        DPSGDConfig.from_mapping(cfg)


def test_secure_rng_fails_fast_explaining_torchcsprng():
    if privacy.secure_rng_available():
        pytest.skip("torchcsprng is installed here")
    with pytest.raises(ValueError, match="'secure-rng'.*torchcsprng"):
        DPSGDConfig.from_mapping({"secure-rng": True})


# --- target-epsilon calibration ---------------------------------------------------------------

def test_target_epsilon_calibration_reaches_target_after_planned_rounds():
    data = make_data(64)
    tc = dict(local_epochs=1, batch_size=8, accumulation_steps=2, lr=0.05, momentum=0.9)
    dc = DPSGDConfig(target_epsilon=2.0, target_delta=1e-5, planned_rounds=3, noise_multiplier=123.0)
    sigma = privacy.resolve_noise_multiplier(
        dc, 64, logical_batch=privacy.logical_batch_size(tc["batch_size"], tc["accumulation_steps"]), local_epochs=1)
    assert sigma == calibrate_noise_multiplier(target_epsilon=2.0, target_delta=1e-5, sample_rate=0.25,
                                               steps=3 * 4, accountant="rdp")
    model, st, eps = tiny_mlp(), None, []
    for rnd in range(3):
        _, _, e, st = train_dp_sgd(model, data, dc, CPU, **tc, seed=rnd, accountant_state=st)
        eps.append(e)
    assert st["noise-multiplier"] == [sigma] and st["steps"] == [12.0]
    assert eps[0] < eps[1] < eps[2]
    assert 0.97 * 2.0 <= eps[2] <= 2.0  # the planned run spends (almost) exactly the budget


def test_calibrated_sigma_spends_target_with_prv():
    # q = 1 keeps this fast: PRV calibration with subsampling takes several seconds here.
    sigma = calibrate_noise_multiplier(target_epsilon=4.0, target_delta=1e-5, sample_rate=1.0, steps=4,
                                       accountant="prv")
    acc = restore_accountant("prv", {"noise-multiplier": [sigma], "sample-rate": [1.0], "steps": [4.0]})
    assert 0.97 * 4.0 <= epsilon_spent(acc, 1e-5) <= 4.0


def test_target_epsilon_zero_means_not_set():
    assert DPSGDConfig.from_mapping({"target-epsilon": 0.0}).target_epsilon is None
