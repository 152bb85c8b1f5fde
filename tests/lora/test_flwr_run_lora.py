"""`flwr run . --run-config "finetune='lora' base-model=..."`: fedcomp's own app in LoRA mode, end to end."""

import json
import shutil

import pytest

from tests.flwr_run import flwr_run


@pytest.mark.slow  # a real `flwr run` / SuperLink: 1-3 minutes
@pytest.mark.skipif(shutil.which("pgrep") is None, reason="needs pgrep to stop the local SuperLink")
def test_flwr_run_lora_mode(tmp_path, corpus, byte_base_dir):
    log, metrics_file = flwr_run(
        tmp_path, 2, f"num-server-rounds=2 dataset='shakespeare' model='transformer' finetune='lora' "
                     f"base-model='{byte_base_dir}' lora-r=4 lora-alpha=8 optimizer='adamw' lr=0.01 batch-size=8 "
                     "compressor='sign' downstream='sign'", ("39691", "39693"))
    assert metrics_file.exists(), log[-3000:]
    rounds = json.loads(metrics_file.read_text())["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert all(r["num-replies"] == 2 and r["rejected-replies"] == 0 and r["failed-clients"] == 0 for r in rounds[1:])
    n_adapters = 1 * 2 * (4 * 32 + 32 * 4)  # 1 layer x (q_proj, v_proj) x (A + B), fp32
    assert all(r["dense-bytes"] == 2 * 4 * n_adapters for r in rounds[1:])  # only adapters travel
    assert rounds[1]["download-bytes"] == 2 * 8 * 4  # the seeded start: one bound per adapter tensor
    assert rounds[2]["download-bytes"] < 2 * n_adapters  # a 1-bit change, not fp32 adapters
    assert all(r["upload-bytes"] < 2 * 4 * n_adapters / 10 for r in rounds[1:])
