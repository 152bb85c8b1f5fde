"""fedcomp's privacy figures against Opacus's own: the client-level epsilon over Poisson-sampled
rounds (empty rounds included) equals Opacus's RDP accountant, and the calibrated noise multiplier
equals Opacus's ``get_noise_multiplier`` on the cases of Opacus's ``accountants_test.py``."""

import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import FedAvg

from fedcomp.client import compression_mod
from fedcomp.privacy import ClientLevelDP, calibrate_noise_multiplier
from fedcomp.privacy.opacus_import import import_opacus
from fedcomp.run.inprocess_grid import InProcessGrid
from fedcomp.strategies import CompressedStrategy, PoissonSampling, Privacy
from tests.messages import reply_with, weights

import_opacus()
from opacus.accountants import RDPAccountant  # noqa: E402
from opacus.accountants.utils import get_noise_multiplier  # noqa: E402


def _client(msg, ctx):
    """A ClientApp that moves every weight by 0.01 (through compression_mod)."""
    def train(m, c):
        rec = m.content["arrays"]
        return reply_with(m, {k: rec[k].numpy() + 0.01 for k in rec.keys()})
    return compression_mod(msg, ctx, train)


def _poisson_run(q: float, z: float, rounds: int, nodes: int, seed: int):
    dp = ClientLevelDP(clipping_norm=1.0, noise_multiplier=z, target_delta=1e-5, sample_rate=q, seed=0)
    s = CompressedStrategy(FedAvg(min_available_nodes=nodes, min_train_nodes=1, fraction_evaluate=0.0),
                           compressor="none", privacy=Privacy(client_dp=dp),
                           sampling=PoissonSampling(q, seed))
    sent, moved = [], []
    configure, aggregate = s.configure_train, s.aggregate_train

    def spy_configure(rnd, arrays, config, grid):
        msgs = configure(rnd, arrays, config, grid)
        sent.append(len(msgs))
        return msgs

    def spy_aggregate(rnd, replies):
        before = {k: v.copy() for k, v in s.sent_round.model.items()}
        arrays, metrics = aggregate(rnd, replies)
        moved.append(None if arrays is None else
                     float(np.sqrt(sum(((arrays[k].numpy() - before[k]) ** 2).sum() for k in before))))
        return arrays, metrics

    s.configure_train, s.aggregate_train = spy_configure, spy_aggregate
    grid = InProcessGrid(_client, nodes, {})
    s.start(grid=grid, initial_arrays=ArrayRecord({k: torch.from_numpy(v) for k, v in weights().items()}),
            num_rounds=rounds, train_config=ConfigRecord({}))
    return s, dp, sent, moved


def _opacus_epsilon(q: float, z: float, steps: int, delta: float = 1e-5) -> float:
    acc = RDPAccountant()
    for _ in range(steps):
        acc.step(noise_multiplier=z, sample_rate=q)
    return acc.get_epsilon(delta=delta)


def test_rounds_that_sampled_nobody_count_and_release_the_noise_alone():
    q, z, rounds = 0.3, 1.0, 8
    s, dp, sent, moved = _poisson_run(q, z, rounds, nodes=3, seed=1)
    assert 0 in sent and any(sent)  # the seed gives empty and non-empty rounds
    assert dp.rounds == rounds
    eps = [s.history[r]["epsilon"] for r in range(1, rounds + 1)]
    assert eps == [dp.epsilon(r) for r in range(1, rounds + 1)]
    assert eps[-1] == pytest.approx(_opacus_epsilon(q, z, rounds), rel=1e-9)
    # an empty round releases N(0, (z * C / (q * N))^2) per coordinate: the model moves by noise alone
    std = z * 1.0 / (q * 3)
    n = sum(v.size for v in weights().values())
    for k, m in zip(sent, moved):
        assert m is not None
        if k == 0:
            assert 0.5 * std * math.sqrt(n) < m < 1.5 * std * math.sqrt(n)


def test_rounds_stopped_by_the_budget_are_not_counted():
    z = 1.0
    dp = ClientLevelDP(clipping_norm=1.0, noise_multiplier=z, target_delta=1e-5, sample_rate=0.3, seed=0)
    s = CompressedStrategy(FedAvg(min_available_nodes=3, min_train_nodes=1, fraction_evaluate=0.0),
                           compressor="none", sampling=PoissonSampling(0.3, 1),
                           privacy=Privacy(client_dp=dp, max_epsilon=(dp.epsilon(2) + dp.epsilon(3)) / 2))
    s.start(grid=InProcessGrid(_client, 3, {}), initial_arrays=ArrayRecord({k: torch.from_numpy(v) for k, v in
                                                                            weights().items()}),
            num_rounds=4, train_config=ConfigRecord({}))
    assert dp.rounds == 2 and "epsilon" not in s.history[3] and "epsilon" not in s.history[4]


# Opacus's accountants_test.py (get_noise_multiplier_*): (accountant, target epsilon, delta, q, steps, its
# expected sigma); "epochs = 90" there is steps = int(90 / 0.04) = 2250. The last rows are points of its
# overshoot property test (epsilon in [1, 10], 10-100 epochs, q in 1e-4..1e-1, delta in 1e-4..1e-6).
OPACUS_CASES = [
    ("rdp", 8.0, 1e-5, 0.04, 2000, 1.3562),
    ("rdp", 8.0, 1e-5, 0.04, 2250, 1.416),
    ("prv", 8.0, 1e-5, 0.04, 2000, 1.2915),
    ("rdp", 1.0, 1e-6, 0.1, 100, None),
    ("rdp", 3.5, 1e-4, 1e-3, int(40 / 1e-3), None),
    ("rdp", 10.0, 1e-5, 0.02, int(10 / 0.02), None),
]


@pytest.mark.parametrize("accountant,eps,delta,q,steps,expected", OPACUS_CASES)
def test_calibrated_noise_multiplier_is_opacus_own(accountant, eps, delta, q, steps, expected):
    calibrate_noise_multiplier.cache_clear()
    sigma = calibrate_noise_multiplier(target_epsilon=eps, target_delta=delta, sample_rate=q, steps=steps,
                                       accountant=accountant)
    if expected is not None:
        assert sigma == pytest.approx(expected, abs=5e-5)  # Opacus's assertAlmostEqual(places=4)
    if accountant == "rdp":  # (PRV's search takes ~12 s here: checked against Opacus's number alone)
        assert sigma == get_noise_multiplier(target_epsilon=eps, target_delta=delta, sample_rate=q, steps=steps,
                                             accountant=accountant)
