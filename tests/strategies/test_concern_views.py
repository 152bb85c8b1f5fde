"""`CompressedStrategy`'s concerns and their settings as read-only attributes (`concern_views`)."""

from __future__ import annotations

import pytest
from flwr.serverapp.strategy import FedAvg

from fedcomp.strategies import Admission, CompressedStrategy, PoissonSampling


@pytest.mark.parametrize("name, concern", [("client_dp", "privacy"), ("max_epsilon", "privacy"),
                                           ("max_num_examples", "admission"), ("require_compression", "admission")])
def test_the_settings_read_on_the_wrapper_are_its_concerns_settings(name, concern):
    s = CompressedStrategy(FedAvg())
    assert getattr(s, name) is getattr(getattr(s, concern), name)


def test_a_concern_cannot_be_swapped_after_construction():
    s = CompressedStrategy(FedAvg())
    with pytest.raises(AttributeError, match="set at construction"):
        s.admission = Admission(max_num_examples=5)


@pytest.mark.parametrize("name", ["max_epsilon", "client_dp", "max_num_examples", "admission", "download"])
def test_settings_read_on_the_wrapper_cannot_be_written_past_their_checks(name):
    s = CompressedStrategy(FedAvg())
    with pytest.raises(AttributeError, match=rf"CompressedStrategy\.{name} is set at construction"):
        setattr(s, name, None)


def test_the_poisson_rate_is_the_sampling_concerns():
    assert CompressedStrategy(FedAvg()).poisson_rate is None
    assert CompressedStrategy(FedAvg(), sampling=PoissonSampling(0.25, seed=1)).poisson_rate == 0.25
