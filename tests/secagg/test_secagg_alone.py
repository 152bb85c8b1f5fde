"""``secagg = true`` and nothing else: the default ``compressor`` (which cannot run under SecAgg) is
resolved to the secure setting; any explicit choice stays as given."""

import json
import logging
import pathlib
import tomllib

import pytest
from flwr.app import Context, RecordDict

from fedcomp.app.config import AppConfig
from fedcomp.config.secagg import (
    SECURE_CODEC,
    SECURE_QUANTIZATION,
    SecAggConfig,
    check_codec_under_secagg,
    resolve_secure_defaults,
    secure_defaults,
    secure_defaults_note,
)

PYPROJECT = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"
DEFAULTS = tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]  # what Flower's run config holds


def test_secagg_alone_resolves_to_the_secure_codec_density_rotation_quantization_and_server_step():
    rc = {**DEFAULTS, "secagg": True}
    cfg = AppConfig.from_run_config(rc)
    sa = SecAggConfig.from_run_config(rc)
    assert (cfg.codec.compressor, cfg.codec.density) == ("randomk", SECURE_CODEC["density"]) == ("randomk", 0.07)
    assert sa.rotation is True
    assert (sa.quantization_bits, sa.clipping_range) == (SECURE_QUANTIZATION["secagg-quantization-bits"],
                                                         SECURE_QUANTIZATION["secagg-clipping-range"]) == (3, 0.05)
    assert sa.server_lr == SECURE_QUANTIZATION["secagg-server-lr"] == 4.0 and sa.server_lr_decay is False
    assert cfg.codec.error_feedback is True and cfg.strategy == "fedavg"
    # the model rides the reference app's download (SecAgg+ hides the updates, not the model); no correction
    assert (cfg.downstream, cfg.downstream_density, cfg.downstream_correction) == ("int8", 0.0, "off")
    check_codec_under_secagg(rc)  # no longer refused
    assert resolve_secure_defaults(resolve_secure_defaults(rc)) == resolve_secure_defaults(rc)
    note = secure_defaults_note(rc)
    assert "compressor = 'randomk'" in note and "density = 0.07" in note and "secagg-rotation = true" in note
    assert "secagg-server-lr = 4" in note
    assert "set compressor = 'randomk'" in note


def test_without_secagg_or_with_a_named_codec_nothing_is_filled_in():
    assert secure_defaults(DEFAULTS) == {} and AppConfig.from_run_config(DEFAULTS).codec.compressor == "stc"
    named = {**DEFAULTS, "secagg": True, "compressor": "randomk"}
    assert (secure_defaults(named) == {} and resolve_secure_defaults(named) is named
            and secure_defaults_note(named) == "")
    sa = SecAggConfig.from_run_config(named)
    assert (sa.rotation, sa.quantization_bits, sa.clipping_range) == (False, 16, 1.0)
    assert AppConfig.from_run_config(named).codec.density == 0.01


def test_explicit_values_win_over_the_secure_setting():
    rc = {**DEFAULTS, "secagg": True, "density": 0.125, "secagg-quantization-bits": 12}
    assert secure_defaults(rc) == {"compressor": "randomk", "secagg-rotation": True,
                                   "secagg-clipping-range": SECURE_QUANTIZATION["secagg-clipping-range"],
                                   "secagg-server-lr": SECURE_QUANTIZATION["secagg-server-lr"]}
    assert SecAggConfig.from_run_config({**rc, "secagg-server-lr": 2.0}).server_lr == 2.0  # an explicit step stays
    assert AppConfig.from_run_config(rc).codec.density == 0.125
    assert SecAggConfig.from_run_config(rc).quantization_bits == 12
    # client-level DP (error feedback off): the codec is chosen, the quantization keeps its defaults
    dp = {**DEFAULTS, "secagg": True, "dp": "client-level", "error-feedback": False}
    assert secure_defaults(dp) == SECURE_CODEC
    assert SecAggConfig.from_run_config(dp).quantization_bits == 16
    assert SecAggConfig.from_run_config(dp).server_lr == 1.0  # no error feedback: no lag to make up for


@pytest.mark.parametrize("codec", ["topk", "qsgd", "sign"])
def test_an_explicit_codec_that_cannot_run_under_secagg_is_still_refused(codec):
    with pytest.raises(ValueError, match=f"'compressor' = '{codec}' cannot work under secure aggregation"):
        check_codec_under_secagg({**DEFAULTS, "secagg": True, "compressor": codec})


def test_secagg_alone_trains_through_the_server_app(tmp_path, caplog):
    """The ServerApp's main on fedcomp's real ClientApp with only ``secagg = true`` (and a short run)."""
    from fedcomp.app.client_app import app as client_app
    from fedcomp.app.server_app import main
    from fedcomp.run.inprocess_grid import InProcessGrid

    rc = {**DEFAULTS, "secagg": True, "num-server-rounds": 3, "results-dir": str(tmp_path)}
    with caplog.at_level(logging.INFO, logger="flwr"):
        main(InProcessGrid(client_app, 4, rc), Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                                       run_config=rc))
    assert sum("secagg = true with compressor at its default" in r.getMessage() for r in caplog.records) == 1
    data = json.loads((tmp_path / "metrics.json").read_text())
    rounds = data["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    assert data["codec"].startswith("secagg+ shared randomk")
    k = round(38282 * SECURE_CODEC["density"])
    bits = SECURE_QUANTIZATION["secagg-quantization-bits"]
    for r in rounds[1:]:
        assert r["num-replies"] == 4 and r["k"] == k and "skipped" not in r
        # 4 clients, Q = 2**bits: modulus ceil(log2(4 * Q + 1)) bits; k values + the weight entry, 15-byte headers
        m = bits + 3
        assert r["modulus-bits"] == m
        assert r["upload-bytes"] == 4 * (15 + (k * m + 7) // 8 + 15 + (m + 7) // 8)
    assert data["secagg"]["rotation"] is True and data["secagg"]["quantization-range"] == 1 << bits
    assert data["secagg"]["server-lr"] == 4.0 and "server-lr=4" in data["codec"]
    # it trains, slowly at first (7 % of the rotated update per round; error feedback carries the rest): the
    # loss falls; three rounds from the seeded start may still answer one class (accuracy near chance)
    assert rounds[-1]["loss"] < rounds[0]["loss"] - 0.004
    assert all(r["download-bytes"] < r["dense-bytes"] / 3 for r in rounds[1:])  # the model travels int8


def test_a_client_whose_weight_rounds_to_zero_is_weighted_at_one_step_not_refused():
    """With few quantization levels (Q = 2**3: one weight step is 125 examples at max-weight 1000) a
    client with 50 examples was refused (weight 0) and left out of every round; it now reports the floor."""
    from fedcomp.secagg.encoding import flower_weight, weight_floor

    from .helpers import num_examples, run_round

    assert weight_floor(1000.0, 8) == 125 and flower_weight(125, 1000.0, 8) == 1 / 8
    assert num_examples(0) < 1000 / 16  # its own weight rounds to 0
    new, strategy, workflow, _ = run_round(4, 0.25, qbits=3, clipping_range=0.05)
    assert strategy.history[1]["num-replies"] == 4 and workflow.round_skipped == {}
    assert workflow.round_modulus_bits == 6  # ceil(log2(4 * 8 + 1))


@pytest.mark.parametrize("n", [0, -5])
def test_a_client_without_examples_is_refused_for_that_not_for_the_max_weight(n):
    """0 or fewer examples is not a weight that rounds to 0: lowering secagg-max-weight would not help."""
    from fedcomp.secagg.encoding import flower_weight

    with pytest.raises(ValueError, match=rf"num-examples = {n}: a client needs at least one training example"):
        flower_weight(n, 1000.0, 8)


@pytest.mark.parametrize(("key", "value", "match"), [
    ("secagg-server-lr", True, "'secagg-server-lr' must be a finite number, got True"),
    ("secagg-clipping-range", True, "'secagg-clipping-range' must be a finite number, got True"),
    ("secagg-rotation", 0, "'secagg-rotation' must be true or false, got 0"),
])
def test_a_value_of_the_wrong_type_equal_to_the_default_is_refused_not_replaced(key, value, match):
    """``True == 1.0`` and ``0 == False`` in Python: ``secagg-server-lr = true`` (default 1.0) was taken
    for "left alone" and silently became the secure step 4 (main: SecAggConfig.server_lr == 4.0; likewise
    clipping range true -> 0.05, rotation 0 -> true); the key's own check now refuses it, naming the key."""
    rc = {**DEFAULTS, "secagg": True, key: value}
    assert key not in secure_defaults(rc)
    with pytest.raises(ValueError, match=match):
        SecAggConfig.from_run_config(rc)
