"""Every run-config key is declared once: pyproject holds exactly the declared keys and defaults,
the settings dataclasses take their defaults from the declarations, and the reference table lists
every key once."""

import dataclasses
import pathlib
import tomllib

import pytest

from fedcomp.app.config import AppConfig
from fedcomp.app.keys import GROUPS, KEYS, reference_table
from fedcomp.config import CodecConfig
from fedcomp.config.codec import CODEC_DEFAULTS, CODEC_KEYS, POLICY_KEYS
from fedcomp.config.secagg import SecAggConfig
from fedcomp.privacy import DPSGDConfig
from fedcomp.task.lora import LoraSettings
from fedcomp.util.declared_key import Key, table

PYPROJECT = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"


def _pyproject_config() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]


def test_pyproject_holds_exactly_the_declared_keys_and_defaults():
    cfg = _pyproject_config()
    assert sorted(cfg) == sorted(KEYS)
    wrong = {k: (cfg[k], key.default) for k, key in KEYS.items()
             if cfg[k] != key.default or type(cfg[k]) is not type(key.default)}
    assert wrong == {}


def test_every_declaration_reads_its_own_default():
    for key in KEYS.values():
        if not key.rule:
            assert key.read({}) == key.default and key.read({key.name: key.default}) == key.default, key.name


def test_the_settings_dataclasses_take_their_defaults_from_the_declarations():
    app = {f.name: f.default for f in dataclasses.fields(AppConfig) if f.name != "codec"}
    assert app == {name: KEYS[name.replace("_", "-")].default for name in app}
    sa = SecAggConfig()
    assert (sa.enabled, sa.shares, sa.threshold, sa.clipping_range, sa.quantization_bits, sa.modulus_bits,
            sa.max_weight, sa.rotation, sa.pack, sa.server_lr, sa.server_lr_decay) == tuple(
        k.default for k in GROUPS["secagg"].values())
    lora = LoraSettings("x")
    assert (lora.r, lora.alpha, ",".join(lora.targets), lora.dropout, lora.quantization) == tuple(
        KEYS[k].default for k in ("lora-r", "lora-alpha", "lora-targets", "lora-dropout", "base-quantization"))
    dp = DPSGDConfig()
    assert (dp.noise_multiplier, dp.max_grad_norm, dp.target_delta, dp.accountant, dp.secure_rng) == tuple(
        KEYS[k].default for k in ("noise-multiplier", "max-grad-norm", "target-delta", "accountant", "secure-rng"))
    assert dp.planned_rounds == KEYS["num-server-rounds"].default and dp.target_epsilon is None
    assert DPSGDConfig.from_mapping({}) == dp and AppConfig.from_run_config({}).finetune == KEYS["finetune"].default


def test_reference_table_lists_every_key_once():
    text = reference_table()
    lines = text.splitlines()
    assert lines[0] == "| key | type | default | allowed | help |" and lines[1].startswith("| --- |")
    names = [line.split("|")[1].strip().strip("`") for line in lines[2:]]
    assert sorted(names) == sorted(KEYS) and len(names) == len(set(names))
    assert all(line.count("|") - line.count("\\|") == 6 for line in lines)
    row = dict(zip(names, lines[2:]))
    assert row["density"].split("|")[3].strip() == "`0.01`"
    assert row["lr"] == "| `lr` | float | `0.1` | number > 0 | client learning rate |"
    assert row["dp"].split("|")[4].strip() == "one of: `none`, `dp-sgd`, `client-level`, `local`, `distributed`"
    assert row["secagg-pack"].split("|")[2:4] == [" bool ", " `true` "]
    assert all(k.help for k in KEYS.values())


def test_every_key_has_its_own_help_and_allowed_values():
    rows = {line.split("|")[1].strip().strip("`"): line.split("|") for line in reference_table().splitlines()[2:]}
    assert [name for name, cols in rows.items() if "CodecConfig" in cols[4] or "codec policy" in cols[5]] == []
    helps = [k.help for k in KEYS.values()]
    assert sorted(h for h in helps if helps.count(h) > 1) == []
    assert rows["error-feedback"][4].strip() == 'true, false or `"ef21"`'
    assert rows["momentum-correction"][2:5] == [" float ", " `0.0` ", " number in [0, 1) "]
    assert rows["schedule-rounds"][4].strip() == "integer >= 1"


def test_the_codec_config_takes_its_defaults_from_the_declarations():
    assert GROUPS["codec"] == CODEC_KEYS and set(POLICY_KEYS) < set(CODEC_KEYS)
    assert {f.name: f.default for f in dataclasses.fields(CodecConfig)} == {
        k.field: k.default for k in CODEC_KEYS.values()}
    assert CODEC_DEFAULTS == {name: k.default for name, k in CODEC_KEYS.items()}
    assert list(CODEC_DEFAULTS)[:3] == ["compressor", "density", "value-dtype"]
    assert CodecConfig.from_mapping({}) == CodecConfig()


def test_the_codec_keys_are_read_in_field_order_with_the_same_messages():
    with pytest.raises(ValueError) as err:
        CodecConfig.from_mapping({"compressor": "zip", "error-feedback": 1})
    assert str(err.value).startswith("run config 'compressor' must be one of ['atomo', ")
    with pytest.raises(ValueError) as err:
        CodecConfig.from_mapping({"residual-dtype": "bf16"}, "train config")
    assert str(err.value) == "train config 'residual-dtype' must be one of ['fp16', 'fp32'], got 'bf16'"
    with pytest.raises(ValueError) as err:
        CodecConfig.from_mapping({"error-feedback": "EF21"})
    assert str(err.value) == "run config 'error-feedback' must be true, false or \"ef21\", got 'EF21'"
    with pytest.raises(ValueError) as err:
        CodecConfig.from_mapping({"layer-codecs": 3})
    assert str(err.value) == "run config 'layer-codecs' must be a string, got 3"


def test_a_key_declared_twice_is_refused():
    with pytest.raises(ValueError, match="'lr' is declared twice"):
        table(Key("lr", float, 0.1, "a"), Key("lr", float, 0.2, "b"))


def test_a_declaration_checks_type_bounds_and_choices():
    k = Key("x", float, 0.5, "help", lo=0.0, hi=1.0, lo_open=True)
    assert k.read({"x": 1}) == 1.0 and k.allowed() == "number in (0, 1]"
    with pytest.raises(ValueError, match=r"run config 'x' must be in \(0.0, 1.0\], got 0.0"):
        k.read({"x": 0.0})
    n = Key("n", int, 2, "help", lo=1)
    assert n.read({"n": 3.0}) == 3 and n.allowed() == "integer >= 1"
    with pytest.raises(ValueError, match="node config 'n' must be an integer"):
        n.read({"n": 2.5}, src="node config")
    s = Key("s", str, "a", "help", choices=("a", "b"))
    with pytest.raises(ValueError, match=r"'s' must be one of \['a', 'b'\], got 'c'"):
        s.read({"s": "c"})
    with pytest.raises(ValueError, match="'f' must be true or false"):
        Key("f", bool, False, "help").read({"f": 1})
