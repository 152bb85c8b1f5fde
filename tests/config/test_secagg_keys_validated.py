"""The secagg-* run-config keys are validated at start-up whether or not secagg is on, and a
server step that overflows float32 is refused at start naming the key."""

import pytest

from fedcomp.app.config import AppConfig
from fedcomp.config.secagg import SECAGG_KEYS, SecAggConfig

NUMBER_KEYS = [k for k, key in SECAGG_KEYS.items() if key.type in (int, float)]


@pytest.mark.parametrize("secagg", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), "abc"])
@pytest.mark.parametrize("key", NUMBER_KEYS)
def test_a_bad_secagg_number_is_refused_naming_the_key(key, bad, secagg):
    cfg = {"secagg": secagg, key: bad}
    with pytest.raises(ValueError, match=f"run config '{key}' must be a finite number, got {bad!r}"):
        AppConfig.from_run_config(cfg)


@pytest.mark.parametrize("key", ["secagg-rotation", "secagg-pack", "secagg-server-lr-decay"])
def test_a_secagg_flag_that_is_not_a_bool_is_refused_with_secagg_off(key):
    with pytest.raises(ValueError, match=f"'{key}'"):
        AppConfig.from_run_config({"secagg": False, key: "abc"})


@pytest.mark.parametrize("secagg", [False, True])
def test_a_server_step_that_overflows_float32_is_refused_at_start(secagg):
    cfg = {"secagg": secagg, "compressor": "randomk", "secagg-server-lr": 1e308}
    with pytest.raises(ValueError, match=r"'secagg-server-lr' = 1e\+308 times secagg-clipping-range = 1 .*float32"):
        AppConfig.from_run_config(cfg)
    with pytest.raises(ValueError, match="'secagg-server-lr'"):
        SecAggConfig.from_run_config({**cfg, "secagg-clipping-range": 1e-30, "secagg-server-lr": 1e300})
    ok = SecAggConfig.from_run_config({**cfg, "secagg-server-lr": 3.4e38 / 2, "secagg-clipping-range": 1.0})
    assert ok.server_lr == 1.7e38


def test_defaults_and_ordinary_values_still_start_with_secagg_off():
    assert AppConfig.from_run_config({"secagg": False}).codec.compressor == "stc"
    assert AppConfig.from_run_config({"secagg": False, "secagg-server-lr": 4.0, "secagg-shares": 5}).dp == "none"
