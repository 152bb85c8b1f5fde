"""fp16/bf16 global models do not stagnate: a mean update below half an ulp of the model's dtype is
not rounded away; the server carries the rounding remainder of each half-precision tensor from
round to round (as the integer rule does), so the model moves as an
fp32 model would, within one ulp, and the remainder survives a checkpoint."""

import logging

import numpy as np
import pytest
import torch
from flwr.serverapp.strategy import FedAvg, FedAvgM

from fedcomp.app import checkpoint
from fedcomp.privacy import ClientLevelDP
from fedcomp.strategies import CompressedStrategy, Privacy
from tests.statedict.test_dtypes import _round

logging.getLogger("flwr").setLevel(logging.WARNING)

START = [1.0, 1.5, -1.25, 0.75, 3.0, -0.5, 1000.0, 0.0625]
ROUNDS = 20


def _ulp(dtype: torch.dtype) -> torch.Tensor:
    """The spacing of the model's dtype at each START value (float32)."""
    t = torch.tensor(START, dtype=dtype).float().abs()
    return torch.finfo(dtype).eps * 2.0 ** torch.floor(torch.log2(t))


def _strategy(inner: str) -> CompressedStrategy:
    if inner == "fedavg":
        return CompressedStrategy(FedAvg(), compressor="none")  # one pre-aggregated reply is the aggregate
    if inner == "fedavgm":
        return CompressedStrategy(FedAvgM(), compressor="none")  # the inner strategy gets one mean reply
    return CompressedStrategy(FedAvg(), compressor="none", aggregation="dense")  # every reply dense


def _trajectory(dtype: torch.dtype, inner: str, strategy: CompressedStrategy | None = None,
                rounds: int = ROUNDS, sd: dict | None = None) -> tuple[list[torch.Tensor], CompressedStrategy]:
    """Client A moves every weight by one ulp of ``dtype`` (+ on even, - on odd entries; exactly
    representable), client B not at all; weights 1 and 9: the mean update is 0.1 ulp a round."""
    strategy = strategy or _strategy(inner)
    step = _ulp(torch.float16 if dtype == torch.float32 else dtype) * torch.tensor([1.0, -1.0] * 4)
    sd = sd or {"w": torch.tensor(START, dtype=dtype)}
    seen = []
    for rnd in range(1, rounds + 1):
        a = {"w": (sd["w"].float() + step).to(dtype)}
        sd = _round(strategy, sd, [a, {"w": sd["w"].clone()}], [1, 9], rnd)
        assert sd["w"].dtype == dtype
        seen.append(sd["w"].float())
    return seen, strategy


@pytest.mark.parametrize("inner", ["fedavg", "fedavgm", "dense"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_model_moves_by_updates_below_half_an_ulp_as_fp32_would(dtype, inner):
    ulp = _ulp(dtype)
    half, _ = _trajectory(dtype, inner)
    exact = torch.tensor(START) + 0.1 * ulp * torch.tensor([1.0, -1.0] * 4) * torch.arange(1, ROUNDS + 1)[:, None]
    for rnd, w in enumerate(half, start=1):
        # within one ulp of the exact trajectory at every round (before: stuck at START, 2 ulp behind)
        assert (torch.abs(w - exact[rnd - 1]) <= ulp).all(), (rnd, w - torch.tensor(START), exact[rnd - 1])
    assert torch.equal(half[-1], exact[-1])  # 20 x 0.1 ulp = 2 ulp: carried to the last bit


def test_the_fp16_trajectory_follows_the_fp32_models():
    """The same clients on an fp32 model: the fp16 model stays within one of its ulps of it."""
    half, _ = _trajectory(torch.float16, "fedavg")
    full, _ = _trajectory(torch.float32, "fedavg")
    assert not torch.equal(full[-1], full[0])
    for w16, w32 in zip(half, full):
        assert (torch.abs(w16 - w32) <= _ulp(torch.float16)).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_half_precision_remainder_is_in_the_state_dict_and_survives_a_checkpoint(tmp_path, dtype):
    seen, strategy = _trajectory(dtype, "fedavg", rounds=3)
    rem = strategy.state_dict()["half-remainders"]["w"]
    assert rem.dtype == np.float32 and rem.shape == (8,)
    assert np.abs(rem).max() > 0  # 0.3 ulp carried
    saved = seen[-1].half().numpy() if dtype == torch.float16 else seen[-1].numpy()  # bf16: its float32 values
    checkpoint.save(tmp_path, 3, {"w": saved}, strategy, [{"round": 3}])
    fresh = _strategy("fedavg")
    checkpoint.load(tmp_path, fresh)
    np.testing.assert_array_equal(fresh.half_remainders["w"], rem)
    # a resumed run continues exactly as the uninterrupted one
    on, _ = _trajectory(dtype, "fedavg", strategy, rounds=2, sd={"w": seen[-1].to(dtype)})
    resumed, _ = _trajectory(dtype, "fedavg", fresh, rounds=2, sd={"w": seen[-1].to(dtype)})
    assert all(torch.equal(a, b) for a, b in zip(on, resumed))


def test_a_checkpoint_with_an_impossible_half_remainder_is_refused(tmp_path):
    _, strategy = _trajectory(torch.float16, "fedavg", rounds=1)
    strategy.half_remainders["w"] = np.full(8, 0.5, np.float32)  # half an ulp of 1.0 in fp16 is 2**-11
    checkpoint.save(tmp_path, 1, {"w": np.ones(8, np.float16)}, strategy, [{"round": 1}])
    with pytest.raises(ValueError, match="remainder of 'w'"):
        checkpoint.load(tmp_path, _strategy("fedavg"))


def test_client_level_dp_on_an_fp16_model_keeps_the_remainder():
    dp = ClientLevelDP(clipping_norm=10.0, noise_multiplier=1e-9, target_delta=1e-5, seed=0)
    strategy = CompressedStrategy(FedAvg(), compressor="none", privacy=Privacy(client_dp=dp))
    remember = strategy.remember
    strategy.remember = lambda rnd, model, sampled=0.0, nodes=None: remember(rnd, model, 2.0, nodes)  # 2 sampled
    sd = {"w": torch.ones(4, dtype=torch.float16)}
    for rnd in range(1, 11):  # each of 2 clients moves by 0.1 ulp: the noisy mean (sum / 2) by 0.1 ulp
        step = torch.full((4,), 0.1 * 2.0**-10)
        trained = {"w": (sd["w"].float() + step).to(torch.float16)}
        assert torch.equal(trained["w"], sd["w"])  # a client alone cannot even express it in fp16
        sd = _round(strategy, sd, [{"w": sd["w"].float() + step}] * 2, [1, 1], rnd)
    assert sd["w"].dtype == torch.float16
    assert torch.allclose(sd["w"].float(), torch.full((4,), 1.0 + 2.0**-10), atol=2.0**-11)  # 1 ulp in 10 rounds
