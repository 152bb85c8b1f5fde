"""CompressedStrategy's own settings: a copy budget must be finite, and a misspelt setting's hint
names the closest known one instead of sending the user to ``.inner``."""

import math

import numpy as np
import pytest
from flwr.serverapp.strategy import FedAvg, FedAvgM

from fedcomp.strategies import CompressedStrategy, Download


@pytest.mark.parametrize("downstream", ["stc", "none"])
@pytest.mark.parametrize("bad", [math.inf, np.float64("inf"), math.nan, 1.0, True, "8"])
def test_an_unbounded_or_bad_copy_budget_is_refused_naming_the_argument(bad, downstream):
    with pytest.raises(ValueError, match=r"^downstream max_copies must be a finite number >= 2 or None"):
        CompressedStrategy(FedAvg(), compressor="stc", downstream=Download(downstream, max_copies=bad))


def test_a_finite_copy_budget_is_kept():
    s = CompressedStrategy(FedAvg(), compressor="stc", downstream=Download("stc", max_copies=1e6))
    assert s.downstream.nodes.max_copies == 1e6


def _message(strategy, name):
    with pytest.raises(AttributeError) as err:
        setattr(strategy, name, 0.5)
    return str(err.value)


def test_a_misspelt_constructor_argument_points_to_the_constructor_argument_not_to_inner():
    s = CompressedStrategy(FedAvgM(), compressor="stc", downstream="stc")
    msg = _message(s, "compresor")
    assert ("Did you mean 'compressor', an argument of CompressedStrategy(...) (pass it when "
            "constructing)?") in msg
    assert "strategy.inner." not in msg and "set the wrapped strategy's own settings on" not in msg
    assert not hasattr(s.inner, "compresor") and "compresor" not in vars(s)


def test_a_misspelt_inner_setting_names_the_inner_one_and_a_wrapper_one_the_wrapper():
    s = CompressedStrategy(FedAvgM(), compressor="stc")
    assert "Did you mean 'server_learning_rate' (of FedAvgM; set on the wrapper, it reaches it)?" in _message(
        s, "server_learnig_rate")
    assert "Did you mean 'max_num_examples' (CompressedStrategy's own)?" in _message(s, "max_num_example")
    msg = _message(s, "zzz")
    assert "Did you mean" not in msg and msg.endswith("a name its strategy does not have would be ignored there")
