"""Run-config validation names the key and the allowed range; defaults match pyproject."""

import pathlib

import pytest
import tomllib

from fedcomp.config import AppConfig, CodecConfig
from fedcomp.secagg.config import SECAGG_DEFAULTS

PYPROJECT = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_pyproject_defaults_parse_and_hold_every_key():
    cfg = tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]
    app = AppConfig.from_run_config(cfg)
    assert app.codec == CodecConfig.from_mapping(cfg)
    assert app.num_server_rounds == 50 and app.codec.compressor == "stc" and app.codec.density == 0.01
    assert app.momentum == 0.9 and app.partitioner == "dirichlet"
    read_keys = {"num-server-rounds", "fraction-train", "min-train-nodes", "min-available-nodes", "strategy",
                 "server-lr", "lr", "momentum", "local-epochs", "batch-size", "accumulation-steps", "seed",
                 "dataset", "model", "partitioner", "dirichlet-alpha", "results-dir", "round-timeout",
                 "uplink-mbps", "downlink-mbps", "dp", "clipping-norm", "noise-multiplier", "max-grad-norm",
                 "target-delta", "target-epsilon", "accountant", "secure-rng", "max-epsilon", "resume", "server-momentum", "downstream", "client-sampling",
                 "client-state-dir", "local-clip-norm",
                 *CodecConfig().to_mapping(), *SECAGG_DEFAULTS}
    assert set(cfg) == read_keys


@pytest.mark.parametrize(
    "key,value,msg",
    [("density", 1.5, r"'density' must be in \(0.0, 1.0\]"), ("density", 0, "'density'"),
     ("levels", 0, "'levels'"), ("block-size", 0, "'block-size'"), ("compressor", "zip", "'compressor' must be one of"),
     ("num-server-rounds", "x", "'num-server-rounds' must be a number"), ("lr", -1.0, "'lr'"),
     ("momentum", 1.0, "'momentum'"), ("batch-size", 2.5, "'batch-size' must be an integer"),
     ("error-feedback", "yes", "'error-feedback' must be true or false"), ("partitioner", "zipf", "'partitioner'"),
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
