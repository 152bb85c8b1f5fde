"""The reference app's run config resolved in one pass (`fedcomp.app.resolve`): each "auto" a pure
function, the result holds no "auto" of the app's keys, and the checks across keys are made there."""

from __future__ import annotations

import pytest

from fedcomp.app.config import AppConfig
from fedcomp.app.resolve import AUTO_DENSITY, resolve_correction, resolve_downstream, resolve_init


def test_the_defaults_resolve_every_auto_of_the_app_keys():
    cfg = AppConfig.from_run_config({})
    assert (cfg.strategy, cfg.downstream, cfg.downstream_init) == ("fedavg", "stc", "seeded")
    assert cfg.downstream_density == AUTO_DENSITY and cfg.downstream_correction == "off"  # SGD: off


@pytest.mark.parametrize("requested, compressor, finetune, secagg, expected", [
    ("auto", "stc", "full", False, ("stc", AUTO_DENSITY)),
    ("auto", "stc", "lora", False, ("sign", 0.0)),
    ("auto", "none", "full", False, ("none", 0.0)),
    ("auto", "randomk", "full", True, ("int8", 0.0)),  # SecAgg+ hides the updates, not the model
    ("auto", "none", "full", True, ("none", 0.0)),
    ("int8", "stc", "full", True, ("int8", 0.0)),
])
def test_resolve_downstream(requested, compressor, finetune, secagg, expected):
    assert resolve_downstream(requested, 0.0, compressor, finetune, secagg) == expected


@pytest.mark.parametrize("requested, finetune, resume, expected", [
    ("auto", "full", False, "seeded"), ("auto", "full", True, "auto"), ("auto", "lora", False, "auto"),
    ("dense", "full", False, "dense"), ("int8", "full", False, "int8"),
])
def test_resolve_init(requested, finetune, resume, expected):
    assert resolve_init(requested, finetune, resume) == expected


@pytest.mark.parametrize("requested, downstream, optimizer, dp, ef, secagg, expected", [
    ("auto", "stc", "adamw", "none", True, False, 1.0), ("auto", "stc", "sgd", "none", True, False, 0.0),
    ("auto", "int8", "adamw", "none", True, False, 0.0), ("auto", "stc", "adamw", "client-level", True, False, 0.0),
    ("auto", "stc", "adamw", "none", "ef21", False, 0.0), ("auto", "none", "adamw", "none", True, False, 0.0),
    ("auto", "stc", "adamw", "none", True, True, 0.0),  # SecAgg+: the server never sees an update
    ("on", "int8", "sgd", "none", True, False, 1.0), ("off", "stc", "adamw", "none", True, False, 0.0),
])
def test_resolve_correction(requested, downstream, optimizer, dp, ef, secagg, expected):
    assert resolve_correction(requested, downstream, optimizer, dp, ef, secagg) == expected


def test_auto_strategy_is_fedavgm_below_the_low_density():
    cfg = AppConfig.from_run_config({"density": 0.001})
    assert (cfg.strategy, cfg.server_lr, cfg.server_momentum) == ("fedavgm", 1.0, 0.5)


def test_the_app_config_records_the_correction_resolved():
    cfg = AppConfig.from_run_config({"optimizer": "adamw"})
    assert cfg.downstream_correction == "on"
    assert AppConfig.from_run_config({"optimizer": "adamw", "downstream-correction": "off"}).downstream_correction \
        == "off"


def test_a_correction_that_cannot_apply_is_refused_when_the_config_is_resolved():
    with pytest.raises(ValueError, match="'downstream-correction' = 'on' cannot apply: .*dense"):
        AppConfig.from_run_config({"downstream": "none", "downstream-correction": "on"})
