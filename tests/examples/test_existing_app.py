"""examples/existing-app: an ordinary Flower app with two fedcomp lines, run in process (and, opt-in, by `flwr run`)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict

from fedcomp.run.inprocess_grid import InProcessGrid
from tests.flwr_run import flwr_run_app

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "existing-app"
RUN_CONFIG = {"num-server-rounds": 2, "fraction-train": 1.0, "fraction-evaluate": 1.0, "min-nodes": 3,
              "local-epochs": 1, "lr": 0.05, "results-file": ""}


@pytest.fixture()
def example(import_example):
    return import_example("existing-app", "existingapp")


def test_the_diff_is_two_marked_lines_plus_their_imports():
    marked = [line.strip() for f in sorted((EXAMPLE / "existingapp").glob("*.py"))
              for line in f.read_text().splitlines() if "# fedcomp" in line]
    assert marked == [
        "from fedcomp.client import compression_mod  # fedcomp",
        "app = ClientApp(mods=[compression_mod])  # fedcomp: was ClientApp()",
        "from fedcomp.strategies import CompressedStrategy  # fedcomp",
        'return CompressedStrategy(fedavg, compressor="sign")  # fedcomp: was `return fedavg`',
    ]
    assert "fedcomp" not in (EXAMPLE / "existingapp" / "task.py").read_text()


def test_existing_app_trains_with_compressed_updates_in_process(example):
    n = 3
    strategy = example["server_app"].make_strategy(RUN_CONFIG)
    grid = InProcessGrid(example["client_app"].app, n, RUN_CONFIG)
    start = ArrayRecord(example["task"].Net().state_dict())
    init = {k: v.numpy().copy() for k, v in start.items()}
    result = strategy.start(grid=grid, initial_arrays=start, num_rounds=2, train_config=ConfigRecord({"lr": 0.05}))
    moved = sum(float(np.abs(result.arrays[k].numpy() - init[k]).sum()) for k in init)
    assert moved > 0
    n_params = sum(v.size for v in init.values())
    for rnd in (1, 2):
        h = strategy.history[rnd]
        assert h["num-replies"] == n and h["rejected-replies"] == 0 and h["failed-clients"] == 0
        assert h["upload-bytes-sign"] == h["upload-bytes"] > 0
        # 1 bit per parameter plus a small header and one scale per tensor, per client
        assert n * n_params / 8 <= h["upload-bytes"] < n * (n_params / 8 + 64 * len(init))
        assert h["dense-bytes"] == n * 4.0 * n_params
    assert set(result.evaluate_metrics_clientapp) == {1, 2}  # evaluate messages pass the mod untouched


def test_existing_serverapp_main_runs_on_the_in_process_grid(example, tmp_path, capsys):
    out = tmp_path / "metrics.json"
    cfg = {**RUN_CONFIG, "min-nodes": 2, "results-file": str(out)}
    grid = InProcessGrid(example["client_app"].app, 2, cfg)
    example["server_app"].app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=cfg))
    assert "existingapp: finished 2 rounds" in capsys.readouterr().out
    train = json.loads(out.read_text())["train"]
    assert [train[r]["num-replies"] for r in ("1", "2")] == [2, 2]
    assert all(train[r]["upload-bytes"] > 0 for r in ("1", "2"))
    # Flower's round record (its log line, its Result): the app's own metric and fedcomp's headline
    # figures; the other 20-odd figures of a round stay in strategy.history
    assert all(set(train[r]) == {"train-loss", "upload-bytes", "download-bytes", "compression-ratio",
                                 "compression-error", "num-replies"} for r in ("1", "2")), train["1"]


@pytest.mark.skipif(os.environ.get("FEDCOMP_SLOW_TESTS") != "1",
                    reason="about 60 s on 2 cores (Ray + a local SuperLink): set FEDCOMP_SLOW_TESTS=1")
@pytest.mark.skipif(shutil.which("pgrep") is None, reason="needs pgrep to stop the local SuperLink")
def test_flwr_run_existing_app(tmp_path):
    app_dir = tmp_path / "existing-app"  # a copy: nothing of the run lands in the repository
    shutil.copytree(EXAMPLE, app_dir, ignore=shutil.ignore_patterns("__pycache__"))
    results = tmp_path / "metrics.json"
    proc = flwr_run_app(app_dir, tmp_path, 2, f"num-server-rounds=2 results-file='{results}'",
                        ("39491", "39493"), timeout=300)  # not the ports of fedcomp's own app run
    assert results.exists(), (proc.stdout + proc.stderr)[-3000:]  # `flwr run` exits 0 even when the run failed
    train = json.loads(results.read_text())["train"]
    for r in ("1", "2"):
        assert train[r]["num-replies"] == 2 and train[r]["upload-bytes"] > 0


@pytest.mark.parametrize("page", ["README.md", "docs/how-to/existing-app.md"])
def test_the_documented_diff_is_the_example_code(page):
    """The README's drop-in example and the guide's show the example's own lines (its codec and
    settings), not other ones."""
    text = (REPO / page).read_text()
    diff = text[text.index("```diff\n # existingapp/client_app.py"):]
    diff = diff[:diff.index("```", 8)]
    added = [ln[1:].split("#")[0].strip() for ln in diff.splitlines() if ln.startswith("+")]
    code = "\n".join(f.read_text() for f in sorted((EXAMPLE / "existingapp").glob("*.py")))
    assert len(added) == 4 and all(a and a in code for a in added), added
