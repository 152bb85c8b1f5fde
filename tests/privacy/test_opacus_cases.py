"""Opacus's own accounting test cases, run through fedcomp's accounting: fedcomp's epsilon and noise
multiplier equal Opacus's on Opacus's own test cases.

The cases (parameters and expected values, not code) are those of Opacus 1.6's
``opacus/tests/accountants_test.py`` (RDP and PRV epsilon, ``get_noise_multiplier`` by steps and by
epochs, its overshoot property, the accountant's state round trip), ``opacus/tests/prv_accountant.py``
(epsilons computed with Microsoft's prv_accountant) and ``privacy_engine_test.py``'s
``test_make_private_with_epsilon``. Each goes through fedcomp's public functions (plain-data
accountant state, :func:`epsilon_spent`, :class:`ClientLevelDP`, :func:`calibrate_noise_multiplier`,
the DP-SGD client's :func:`resolve_noise_multiplier` / :func:`projected_epsilon`) and is compared with
Opacus's number at Opacus's tolerance and, where that is cheap, with Opacus's own function exactly.
Opacus's GDP accountant is not offered by fedcomp (run config ``accountant``: rdp, prv), so its cases
check that fedcomp refuses it. PRV cases with 20,000+ steps take minutes each here: marked slow.
"""

import pytest

from fedcomp.privacy import (
    ClientLevelDP,
    DPSGDConfig,
    accountant_state,
    calibrate_noise_multiplier,
    epsilon_spent,
    new_accountant,
    projected_epsilon,
    resolve_noise_multiplier,
    restore_accountant,
)
from fedcomp.privacy.opacus_import import import_opacus

import_opacus()
from opacus.accountants import RDPAccountant, create_accountant  # noqa: E402
from opacus.accountants.utils import get_noise_multiplier  # noqa: E402


def _history(sigma: float, q: float, steps: int) -> dict:
    """fedcomp's plain-data accountant state of ``steps`` steps at (sigma, q)."""
    return {"noise-multiplier": [sigma], "sample-rate": [q], "steps": [float(steps)]}


def _fedcomp_epsilon(kind: str, sigma: float, q: float, steps: int, delta: float) -> float:
    return epsilon_spent(restore_accountant(kind, _history(sigma, q, steps)), delta)


def _opacus_epsilon(kind: str, sigma: float, q: float, steps: int, delta: float) -> float:
    acc = create_accountant(mechanism=kind)
    acc.history = [(sigma, q, steps)]
    return acc.get_epsilon(delta=delta)


# -- accountants_test.py: epsilon --------------------------------------------------------

def test_rdp_epsilon_of_accountants_test():
    sigma, q, steps = 1.5, 0.04, int(90 / 0.04)
    opacus = RDPAccountant()
    for _ in range(steps):
        opacus.step(noise_multiplier=sigma, sample_rate=q)
    ours = epsilon_spent(restore_accountant("rdp", accountant_state(opacus)), 1e-5)
    assert ours == pytest.approx(7.32911117143, abs=5e-8)  # Opacus: assertAlmostEqual (7 places)
    assert ours == opacus.get_epsilon(delta=1e-5)
    # client-level DP: the same mechanism, one round a step
    assert ClientLevelDP(1.0, sigma, 1e-5, sample_rate=q).epsilon(steps) == opacus.get_epsilon(delta=1e-5)


def test_prv_epsilon_of_accountants_test():
    sigma, q, steps = 1.5, 0.04, int(90 // 0.04)
    ours = _fedcomp_epsilon("prv", sigma, q, steps, 1e-5)
    assert ours == pytest.approx(6.777395712150674, abs=5e-8)
    assert ours == _opacus_epsilon("prv", sigma, q, steps, 1e-5)


def test_the_accountant_state_round_trip_of_accountants_test():
    """test_accountant_load_state_dict: 1250 steps, saved, restored, 1000 more: Opacus's epsilon."""
    sigma, q, steps = 1.5, 0.04, int(90 / 0.04)
    acc = new_accountant("rdp")
    for _ in range(steps - 1000):
        acc.step(noise_multiplier=sigma, sample_rate=q)
    state = accountant_state(acc)  # what a client keeps in context.state between rounds
    resumed = restore_accountant("rdp", state)
    assert resumed.history == acc.history
    for _ in range(1000):
        resumed.step(noise_multiplier=sigma, sample_rate=q)
    assert epsilon_spent(resumed, 1e-5) == pytest.approx(7.32911117143, abs=5e-8)


# -- prv_accountant.py: Microsoft's prv_accountant values (delta = 1e-6) -----------------------

MSR_VALUES = {
    (0.8, 0.001, 100): 0.270403364058018680360362395731,
    (1.5, 0.001, 100): 0.0393694193095203287535710501288,
    (2.0, 0.001, 100): 0.0291045369484074882560076247273,
    (3.0, 0.001, 100): 0.0215200934390882663016508757892,
    (0.8, 0.05, 100): 6.74105193941409996938318727189,
    (1.5, 0.05, 100): 1.95385313568420015961635272106,
    (2.0, 0.05, 100): 1.28363737962406521120328761754,
    (3.0, 0.05, 100): 0.767933789666825572517439013609,
    (0.8, 0.2, 100): 24.3336641779225644199868838768,
    (1.5, 0.2, 100): 8.49897785912163072907787864096,
    (2.0, 0.2, 100): 5.67205560882372950004537415225,
    (3.0, 0.2, 100): 3.38122051022184422208738396876,
    (0.8, 0.001, 1000): 0.477771266184522591657923840103,
    (1.5, 0.001, 1000): 0.0998206602308474855167474970585,
    (2.0, 0.001, 1000): 0.0712187825381152272985474382949,
    (3.0, 0.001, 1000): 0.0476159308713589302097801692071,
    (0.8, 0.05, 1000): 19.5258428053837356230815203162,
    (1.5, 0.05, 1000): 6.20996924657726712126759593957,
    (2.0, 0.05, 1000): 4.17279986668931890392286732094,
    (3.0, 0.05, 1000): 2.52757432605973830774814814504,
    (0.8, 0.001, 20000): 1.29600925757016161021795142005,
    (1.5, 0.001, 20000): 0.437005108654860807693154356457,
    (2.0, 0.001, 20000): 0.305837939762453436820521801565,
    (3.0, 0.001, 20000): 0.194031030686054706269061398416,
    (1.5, 0.05, 20000): 38.3066179140872336006395926233,
    (2.0, 0.05, 20000): 24.4217185703225858617315680021,
    (3.0, 0.05, 20000): 13.9611146992367061159256991232,
    (0.8, 0.001, 50000): 2.03451480771586634688219419331,
    (1.5, 0.001, 50000): 0.704218384555810095193351116905,
    (2.0, 0.001, 50000): 0.491354910211401318953505779064,
    (3.0, 0.001, 50000): 0.309694161156544023327796821832,
    (1.5, 0.05, 50000): 73.1901767238329625797632616013,
    (2.0, 0.05, 50000): 45.2369958613306906158868514467,
    (3.0, 0.05, 50000): 24.9420056431444763234139827546,
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c[2] >= 20000 else c
                                  for c in MSR_VALUES], ids=str)
def test_prv_epsilon_of_prv_accountant_tests(case):
    sigma, q, steps = case
    ours = _fedcomp_epsilon("prv", sigma, q, steps, 1e-6)
    assert ours == pytest.approx(MSR_VALUES[case], abs=5e-5)  # Opacus: assertAlmostEqual(places=4)


# -- accountants_test.py: noise multiplier -------------------------------------------------

# (accountant, target epsilon, delta, q, steps, Opacus's expected sigma); "epochs = 90" is
# int(90 / 0.04) = 2250 steps, as get_noise_multiplier turns epochs into steps.
NOISE_CASES = [
    ("rdp", 8.0, 1e-5, 0.04, 2000, 1.3562),
    ("rdp", 8.0, 1e-5, 0.04, int(90 / 0.04), 1.416),
    pytest.param("prv", 8.0, 1e-5, 0.04, 2000, 1.2915, marks=pytest.mark.slow),
    pytest.param("prv", 8.0, 1e-5, 0.04, int(90 / 0.04), 1.34765625, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("accountant,eps,delta,q,steps,expected", NOISE_CASES)
def test_noise_multiplier_of_accountants_test(accountant, eps, delta, q, steps, expected):
    calibrate_noise_multiplier.cache_clear()
    sigma = calibrate_noise_multiplier(target_epsilon=eps, target_delta=delta, sample_rate=q, steps=steps,
                                       accountant=accountant)
    assert sigma == pytest.approx(expected, abs=5e-5)  # Opacus: assertAlmostEqual(places=4)
    assert sigma == get_noise_multiplier(target_epsilon=eps, target_delta=delta, sample_rate=q, steps=steps,
                                         accountant=accountant)


def test_the_gdp_accountant_of_accountants_test_is_refused_by_name():
    """test_gdp_accountant / test_get_noise_multiplier_gdp: fedcomp offers rdp and prv only."""
    with pytest.raises(ValueError, match="'accountant' must be one of \\['rdp', 'prv'\\], got 'gdp'"):
        new_accountant("gdp")
    with pytest.raises(ValueError, match="'accountant' must be one of"):
        DPSGDConfig(accountant="gdp")


# test_get_noise_multiplier_overshoot's ranges (hypothesis: epsilon in [1, 10], epochs in [10, 100], q
# from its list, delta from its list), at fixed points that cover the corners.
OVERSHOOT = [(eps, epochs, q, delta) for eps, epochs, q, delta in [
    (1.0, 10, 1e-4, 1e-4), (1.0, 100, 1e-1, 1e-6), (10.0, 10, 1e-1, 1e-4), (10.0, 100, 1e-4, 1e-6),
    (2.5, 37, 2e-4, 1e-5), (7.7, 20, 1e-3, 1e-6), (5.0, 50, 5e-3, 1e-5), (9.1, 80, 2e-2, 1e-6),
]]


@pytest.mark.parametrize("eps,epochs,q,delta", OVERSHOOT)
def test_calibrated_noise_never_overshoots_and_is_opacus_own(eps, epochs, q, delta):
    steps = int(epochs / q)
    sigma = calibrate_noise_multiplier(target_epsilon=eps, target_delta=delta, sample_rate=q, steps=steps)
    assert sigma == get_noise_multiplier(target_epsilon=eps, target_delta=delta, sample_rate=q, epochs=epochs)
    spent = _fedcomp_epsilon("rdp", sigma, q, steps, delta)
    assert spent == _opacus_epsilon("rdp", sigma, q, steps, delta)
    assert eps - 0.01 <= spent < eps  # Opacus: below the target, by at most its tolerance


# -- privacy_engine_test.py: make_private_with_epsilon ------------------------------------

def test_a_dp_sgd_client_calibrated_to_epsilon_spends_it_as_make_private_with_epsilon():
    """512 examples, batches of 64 (q = 1/8), 2 epochs (here: 2 rounds of 1 local epoch), target
    epsilon 2 at delta 1e-5: the same sigma as Opacus's make_private_with_epsilon, and epsilon 2.0 to
    2 places after the planned steps."""
    dp = DPSGDConfig(target_epsilon=2.0, target_delta=1e-5, planned_rounds=2)
    train = {"logical_batch": 64, "local_epochs": 1}  # batches of 64, one local epoch a round
    sigma = resolve_noise_multiplier(dp, 512, **train)
    assert sigma == get_noise_multiplier(target_epsilon=2.0, target_delta=1e-5, sample_rate=1 / 8, epochs=2)
    after_one = _history(sigma, 1 / 8, 8)  # round 1's 8 steps, as the client keeps them
    eps = projected_epsilon(dp, 512, after_one, **train)  # + round 2's 8 steps
    assert eps == pytest.approx(2.0, abs=5e-3)  # Opacus: assertAlmostEqual(target, get_epsilon, places=2)
    assert eps == _opacus_epsilon("rdp", sigma, 1 / 8, 16, 1e-5)
