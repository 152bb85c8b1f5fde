"""What metrics.json says about the run's privacy, and how DP settings name their errors."""

import pytest

from fedcomp.app.config import AppConfig
from fedcomp.privacy import ClientLevelDP
from fedcomp.app.server_app import privacy_statement


@pytest.mark.parametrize("dp, run_config, want", [
    ("dp-sgd", {"accountant": "prv"}, "prv"),
    ("dp-sgd", {}, "rdp"),
    ("client-level", {"accountant": "prv"}, "rdp"),  # the server's own accounting is RDP
    ("local", {}, "rdp"),
])
def test_the_statement_names_the_accountant_in_use(dp, run_config, want):
    assert privacy_statement(AppConfig(dp=dp), run_config)["accountant"] == want


def test_a_bad_client_level_sample_rate_is_named_as_such():
    with pytest.raises(ValueError, match=r"^sample_rate \(Poisson rate q.* must be in \(0.0, 1.0\], got 1.5"):
        ClientLevelDP(1.0, 1.0, sample_rate=1.5)
    with pytest.raises(ValueError, match=r"run config 'clipping-norm' must be in \(0.0, inf\)"):
        ClientLevelDP(0.0, 1.0)
