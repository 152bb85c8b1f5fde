"""The DDP example (launched with torchrun) and the DDP hook benchmark run; the example and the package
stay free of Flower and of the reference app."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.distributed.ranks import free_port

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "ddp" / "train.py"


def test_the_example_imports_only_the_library():
    tree = ast.parse(EXAMPLE.read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    fedcomp = {m for m in modules if m.startswith("fedcomp")}
    assert fedcomp == {"fedcomp.distributed"}
    assert not {m for m in modules if m.startswith("flwr")}


def test_the_package_loads_no_flower():
    code = "import sys, fedcomp.distributed\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'flwr'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_the_example_runs_under_torchrun(tmp_path):
    metrics = tmp_path / "metrics.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(EXAMPLE),
                          "--compressor", "stc", "--density", "0.01", "--steps", "60", "--log-every", "20",
                          "--metrics", str(metrics)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("MB/rank") == 3 and "ratio" in out.stdout
    data = json.loads(metrics.read_text())
    final = data["final"]
    assert data["config"]["world_size"] == 2 and final["step"] == 60
    assert final["ratio"] > 10 and final["mb_sent"] > 0 and 0.0 <= final["accuracy"] <= 1.0
    assert data["hook"]["step"] == 60


@pytest.mark.slow
def test_the_benchmark_runs_quick(tmp_path):
    out = tmp_path / "ddp_hook.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "ddp_hook.py"), "--quick", "--out", str(out)],
                   check=True, capture_output=True, timeout=400)
    runs = {r["side"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"ddp (fp32 allreduce)", "torch fp16 hook", "torch PowerSGD r1", "fedcomp stc 0.01"}
    assert all(r.get("replicas_identical") for r in runs.values()), runs
    assert runs["fedcomp stc 0.01"]["bytes_per_step"] < runs["torch fp16 hook"]["bytes_per_step"]
