"""A path-like ``base-model`` is a local directory only, a file such as
config.json is refused, and ``lora-r`` is bounded at config time."""

import os

import pytest

from fedcomp.task.lora import MAX_LORA_R, LoraSettings, _source, adapter_shapes, base_config


def test_a_missing_dot_slash_base_model_is_not_looked_up_on_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"no such directory \./gpt2 .*never a Hugging Face hub id") as err:
        _source("./gpt2")  # before the fix: "gpt2", then a hub look-up
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="no such directory"):
        base_config(LoraSettings("./gpt2"))  # at once, no from_pretrained call
    (tmp_path / "gpt2").mkdir()
    assert _source("./gpt2") == "./gpt2"  # the local directory, as written
    monkeypatch.setenv("HOME", str(tmp_path))
    assert _source("~/gpt2") == str(tmp_path / "gpt2")  # "~" expanded
    assert _source("gpt2") == "gpt2"  # cwd holds ./gpt2, but a bare name that exists is a directory too
    assert _source("openai-community/gpt2") == "openai-community/gpt2"  # a hub id stays a hub id


def test_a_config_json_path_as_base_model_is_refused(base_dir):
    config = os.path.join(base_dir, "config.json")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        adapter_shapes(LoraSettings(config))
    assert adapter_shapes(LoraSettings(base_dir, r=4))  # the directory itself still works


def test_an_absurd_lora_rank_is_refused_at_config_time():
    with pytest.raises(ValueError, match=r"'lora-r' must be an integer in \[1, 65536\], got 1000000000000"):
        LoraSettings.from_mapping({"base-model": "x", "lora-r": 10**12})
    assert LoraSettings.from_mapping({"base-model": "x", "lora-r": MAX_LORA_R}).r == MAX_LORA_R
