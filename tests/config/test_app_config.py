"""Run-config validation names the key and the allowed range; defaults match pyproject."""

import dataclasses
import math
import pathlib
import tomllib

import pytest

from fedcomp.app.config import AppConfig
from fedcomp.app.keys import APP_KEYS, check_known_keys, run_config_keys
from fedcomp.config import CodecConfig

PYPROJECT = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"


def _float_keys(cls) -> list[str]:
    return [f.name.replace("_", "-") for f in dataclasses.fields(cls) if f.type == "float"]


FLOAT_KEYS = _float_keys(AppConfig) + _float_keys(CodecConfig)


def test_pyproject_defaults_parse_and_hold_every_key():
    cfg = tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]
    app = AppConfig.from_run_config(cfg)
    assert app.codec == CodecConfig.from_mapping(cfg)
    assert app.num_server_rounds == 50 and app.codec.compressor == "stc" and app.codec.density == 0.01
    assert app.momentum == 0.9 and app.partitioner == "dirichlet"
    # the apps' key registry and pyproject hold the same keys (a key added to one only is caught here)
    assert set(cfg) == run_config_keys()
    assert len(APP_KEYS) == len(set(APP_KEYS)) and not set(APP_KEYS) & set(CodecConfig().to_mapping())


@pytest.mark.parametrize(
    "key,value,msg",
    [("density", 1.5, r"'density' must be in \(0.0, 1.0\]"), ("density", 0, "'density'"),
     ("levels", 0, "'levels'"), ("block-size", 0, "'block-size'"), ("compressor", "zip", "'compressor' must be one of"),
     ("num-server-rounds", "x", "'num-server-rounds' must be a number"), ("lr", -1.0, "'lr'"),
     ("momentum", 1.0, "'momentum'"), ("batch-size", 2.5, "'batch-size' must be an integer"),
     ("error-feedback", "yes", "'error-feedback' must be true, false or \"ef21\""),
     ("partitioner", "zipf", "'partitioner'"),
     ("selection", "layer", "'selection'"), ("dirichlet-alpha", 0.0, "'dirichlet-alpha'")],
)
def test_bad_values_name_the_key(key, value, msg):
    with pytest.raises(ValueError, match=msg):
        AppConfig.from_run_config({key: value})


def test_scope_resolution():
    assert CodecConfig(compressor="stc").scope == "model"
    assert CodecConfig(compressor="sign").scope == "tensor"
    assert CodecConfig(compressor="sign", selection="model").scope == "model"
    assert CodecConfig(compressor="topk", selection="tensor").scope == "tensor"


@pytest.mark.parametrize("key,closest", [("densty", "density"), ("num-rounds", "num-server-rounds"),
                                         ("compresor", "compressor"), ("noise_multiplier", "noise-multiplier"),
                                         ("learning-rate", None)])
def test_unknown_run_config_key_is_refused_naming_the_closest(key, closest):
    """A misspelt key is refused, naming the closest known key, never ignored for its default."""
    with pytest.raises(ValueError) as err:
        AppConfig.from_run_config({"density": 0.05, key: 0.05})
    msg = str(err.value)
    assert msg.startswith(f"run config key '{key}' is unknown; ") and "\n" not in msg
    assert (f"did you mean '{closest}'?" in msg) if closest else ("no similar key" in msg)


def test_known_keys_pass_and_a_custom_set_is_honoured():
    check_known_keys({k: None for k in run_config_keys()})
    with pytest.raises(ValueError, match="node config key 'colour' is unknown; did you mean 'color'"):
        check_known_keys({"colour": 1}, frozenset({"color"}), source="node config")


def test_every_float_key_is_found():
    # The enumeration must see these common float keys (and every other float key).
    assert {"lr", "server-lr", "dirichlet-alpha", "density", "target-delta", "round-timeout"} <= set(FLOAT_KEYS)


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_float_values_are_refused_at_start_up_naming_the_key(key, value):
    with pytest.raises(ValueError, match=f"run config '{key}' must be a finite number"):
        AppConfig.from_run_config({key: value})


@pytest.mark.parametrize("key", ["lr", "server-lr", "dirichlet-alpha"])
def test_large_finite_rates_are_still_accepted(key):
    cfg = AppConfig.from_run_config({key: 1e30})
    assert getattr(cfg, key.replace("-", "_")) == 1e30
