"""Regression tests for issue 14 (attack review): infinite config values, shared message records
in the in-process grid, torn checkpoints, resume with another codec."""

import dataclasses
import math

import pytest

from fedcomp.config import AppConfig, CodecConfig


def _float_keys(cls) -> list[str]:
    return [f.name.replace("_", "-") for f in dataclasses.fields(cls) if f.type == "float"]


FLOAT_KEYS = _float_keys(AppConfig) + _float_keys(CodecConfig)


def test_every_float_key_is_found():
    # The enumeration must see the keys the issue names (and every other float key).
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
