"""examples/lora-finetune: a FlowerTune-style LoRA app with a few marked fedcomp lines, run in process
and by `flwr run` (the LoRA mode end to end)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import pytest
from flwr.app import Context, RecordDict

from fedcomp.run.inprocess_grid import InProcessGrid
from tests.flwr_run import flwr_run_app

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "lora-finetune"


@pytest.fixture()
def example(import_example):
    return import_example("lora-finetune", "lorafinetune")


def _config(base: str, **kw) -> dict:
    return {"num-server-rounds": 3, "fraction-train": 0.5, "min-nodes": 4, "base-model": base, "lora-r": 4,
            "lora-alpha": 8, "lora-targets": "q_proj,v_proj", "local-steps": 2, "lr": 0.003, "seed": 0,
            "results-file": "", **kw}


def test_the_fedcomp_lines_are_few_and_marked():
    marked = [line.strip() for f in sorted((EXAMPLE / "lorafinetune").glob("*.py"))
              for line in f.read_text().splitlines() if "# fedcomp" in line]
    assert len(marked) == 4 and all("fedcomp" in m for m in marked)  # two imports, the mod, the preset
    assert "fedcomp" not in (EXAMPLE / "lorafinetune" / "task.py").read_text().replace("fedcomp.task.text_data", "")


def test_example_runs_in_process_with_small_downloads(example, corpus, byte_base_dir, tmp_path, capsys):
    out = tmp_path / "metrics.json"
    cfg = _config(byte_base_dir, **{"results-file": str(out)})
    grid = InProcessGrid(example["client_app"].app, 4, cfg)
    example["server_app"].app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=cfg))
    assert "lorafinetune: finished 3 rounds" in capsys.readouterr().out
    res = json.loads(out.read_text())
    n_params = 1 * 2 * (4 * 32 + 32 * 4)  # 1 layer x (q_proj, v_proj) x (A + B)
    dense = 4 * n_params
    rounds = res["rounds"]
    assert [rounds[r]["num-replies"] for r in ("1", "2", "3")] == [2, 2, 2]
    assert rounds["1"]["download-bytes"] == 2 * 8 * 4  # seeded start (preset "lora"): one bound per adapter tensor
    assert all(rounds[r]["upload-bytes"] < 2 * dense / 8 for r in ("1", "2", "3"))  # sign: 1 bit per entry + headers
    assert all(0 < rounds[r]["download-bytes"] < 2 * dense / 8 for r in ("2", "3"))  # sign payloads or catch-ups


@pytest.mark.skipif(os.environ.get("FEDCOMP_SLOW_TESTS") != "1",
                    reason="about 60 s on 2 cores (Ray + a local SuperLink; tests/lora/test_flwr_run_lora.py runs "
                           "LoRA mode by flwr run in CI): set FEDCOMP_SLOW_TESTS=1")
@pytest.mark.skipif(shutil.which("pgrep") is None, reason="needs pgrep to stop the local SuperLink")
def test_flwr_run_lora_example(tmp_path, corpus, byte_base_dir):
    app_dir = tmp_path / "lora-finetune"  # a copy: nothing of the run lands in the repository
    shutil.copytree(EXAMPLE, app_dir, ignore=shutil.ignore_patterns("__pycache__"))
    results = tmp_path / "metrics.json"
    proc = flwr_run_app(app_dir, tmp_path, 2, f"num-server-rounds=2 min-nodes=2 fraction-train=1.0 "
                        f"base-model='{byte_base_dir}' results-file='{results}'",
                        ("39591", "39593"), timeout=400)  # not the ports of the other flwr run tests
    assert results.exists(), (proc.stdout + proc.stderr)[-3000:]  # `flwr run` exits 0 even when the run failed
    rounds = json.loads(results.read_text())["rounds"]
    assert [rounds[r]["num-replies"] for r in ("1", "2")] == [2, 2]
    assert rounds["1"]["download-bytes"] == 2 * 8 * 4  # the seed, not the adapters
    assert 0 < rounds["2"]["download-bytes"] < 2 * 4 * 1024 / 4  # a compressed change
