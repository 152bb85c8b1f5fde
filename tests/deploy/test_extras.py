"""The dependency split: a core install (flwr without Ray, numpy, torch) runs a ClientApp round; every
extra is imported only where it is needed and a missing one says which extra to install."""

import json
import pathlib
import re
import subprocess
import sys
import tomllib

import numpy as np
import pytest
import torch

from fedcomp.task.data import DataConfig, load_partition
from fedcomp.task.datafiles import load_partition_file, save_partitions
from fedcomp.util.extras import require

REPO = pathlib.Path(__file__).resolve().parents[2]
EXTRA_MODULES = ("ray", "matplotlib", "sklearn", "scipy", "opacus", "flwr_datasets", "datasets", "pandas", "pyarrow")


def _pyproject():
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_core_dependencies_are_what_a_supernode_needs():
    core = _pyproject()["dependencies"]
    names = sorted(d.split("[")[0].split("=")[0].split(">")[0].split("<")[0] for d in core)
    assert names == ["flwr", "numpy", "torch"]
    assert "flwr==1.42.0" in core  # no [simulation]: no Ray on a SuperNode
    torch_req = next(d for d in core if d.startswith("torch"))
    assert "==" not in torch_req  # a range; vendor builds fit


def test_the_core_accepts_the_torch_releases_it_supports():
    """Installing fedcomp into an app with torch 2.14.1 downgraded it to 2.13.0 (``torch<2.14``): the
    range holds every release from 2.4 on, the constraints pin (CI) and arm64's 2.7.1 included."""
    from packaging.requirements import Requirement

    spec = Requirement(next(d for d in _pyproject()["dependencies"] if d.startswith("torch"))).specifier
    pinned = next(ln.split("==")[1].strip() for ln in (REPO / "constraints.txt").read_text().splitlines()
                  if ln.startswith("torch=="))
    assert all(spec.contains(v) for v in ("2.4.0", "2.7.1", pinned, "2.14.1", "2.15.0"))
    assert not spec.contains("2.3.1")


def test_dev_extra_includes_every_other_extra_and_constraints_pin_the_tested_torch():
    extras = _pyproject()["optional-dependencies"]
    dev_self = next(d for d in extras["dev"] if d.startswith("fedcomp["))
    included = set(dev_self[len("fedcomp["):-1].split(","))
    assert included == set(extras) - {"dev"}
    assert "flwr[simulation]==1.42.0" in extras["simulation"]
    lines = [ln.strip() for ln in (REPO / "constraints.txt").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert "torch==2.13.0" in lines
    assert torch.__version__.split("+")[0] == "2.13.0"  # CI runs what constraints.txt pins


@pytest.mark.parametrize("module,extra", [("sklearn.datasets", "data"), ("flwr_datasets", "data"),
                                          ("matplotlib", "plots"), ("opacus", "dp"), ("transformers", "llm")])
def test_require_names_the_extra(monkeypatch, module, extra):
    for name in {module, module.split(".")[0]}:  # importing a None entry raises ModuleNotFoundError
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ModuleNotFoundError, match=rf"pip install -e '\.\[{extra}\]' in a fedcomp checkout, or "
                                                  rf"pip install 'fedcomp\[{extra}\] @ <wheel file or git URL"):
        require(module, "this path")
    assert require("json", "x") is json


def test_every_install_hint_says_how_without_a_package_index():
    """fedcomp is not on the package index: a bare ``pip install 'fedcomp[x]'`` in a message cannot work."""
    bare = [str(p.relative_to(REPO)) for p in sorted((REPO / "fedcomp").rglob("*.py"))
            if re.search(r"pip install 'fedcomp\[[^\]]*\]'", p.read_text())]
    assert bare == []


def test_data_without_the_data_extra_says_so(monkeypatch):
    load_partition.cache_clear()
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(ModuleNotFoundError, match=r"fedcomp\[data\]"):
        load_partition(DataConfig(seed=12345), 0, 3)
    load_partition.cache_clear()


def test_plot_is_skipped_without_matplotlib(monkeypatch, tmp_path):
    from fedcomp.app.results import plot_rounds

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plot_rounds([{"round": 0, "accuracy": 0.1}], tmp_path / "plot.png", "t") is False
    assert not (tmp_path / "plot.png").exists()


def test_partition_file_equals_the_computed_partition_and_refuses_other_settings(tmp_path):
    cfg = DataConfig()
    paths = save_partitions(cfg, 3, tmp_path)
    assert [p.name for p in paths] == ["partition-0.npz", "partition-1.npz", "partition-2.npz"]
    for pid, path in enumerate(paths):
        a, b = load_partition_file(path, cfg, pid, 3).tensors, load_partition(cfg, pid, 3).tensors
        assert a[0].dtype == torch.float32 and a[1].dtype == torch.int64
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="other data settings.*partition-id"):
        load_partition_file(paths[0], cfg, 1, 3)
    with pytest.raises(ValueError, match="other data settings.*seed"):
        load_partition_file(paths[0], DataConfig(seed=1), 0, 3)
    bad = tmp_path / "bad.npz"
    np.savez(bad, images=np.zeros((2, 1, 8, 8), np.float64), labels=np.zeros(2, np.int64), meta=np.array("{}"))
    with pytest.raises(ValueError, match="float32"):
        load_partition_file(bad, cfg, 0, 3)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a fedcomp partition file"):
        load_partition_file(tmp_path / "junk.npz", cfg, 0, 3)
    # a file cut short (a copy interrupted): one line, not zipfile's traceback
    for cut in (100, paths[0].stat().st_size // 2, paths[0].stat().st_size - 10):
        (tmp_path / "torn.npz").write_bytes(paths[0].read_bytes()[:cut])
        with pytest.raises(ValueError, match="torn.npz is not a fedcomp partition file"):
            load_partition_file(tmp_path / "torn.npz", cfg, 0, 3)


BLOCKED_ROUND = r"""
import json, sys, time
BLOCK = sys.argv[2].split(",")
for name in BLOCK:  # a None entry: `import name` raises ModuleNotFoundError, importlib.util.find_spec gives None
    sys.modules[name] = None
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, Metadata, RecordDict
from fedcomp.app.client_app import app
from fedcomp.task.models import build_model
md = Metadata(run_id=1, message_id="m1", src_node_id=1, dst_node_id=7, reply_to_message_id="", group_id="1",
              created_at=time.time(), ttl=3600.0, message_type="train")
msg = Message(content=RecordDict({"arrays": ArrayRecord(build_model().state_dict()),
                                  "config": ConfigRecord({"compressor": "stc", "server-round": 1})}), metadata=md)
ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 3, "data-file": sys.argv[1]},
              state=RecordDict(), run_config={"local-epochs": 1})
reply = app(msg, ctx)
assert not reply.has_error(), reply.error
m = reply.content["metrics"]
upload = sum(len(a.data) for a in reply.content["arrays"].values())  # the payloads (the server counts them)
print(json.dumps({"upload": float(upload), "n": int(m["num-examples"]),
                  "loaded": sorted(k for k, v in sys.modules.items() if v is not None and k.split(".")[0] in BLOCK)}))
"""


def test_client_round_runs_with_every_extra_blocked(tmp_path):
    """What a core-only SuperNode executes: a train round of the default ClientApp on its partition file,
    in a fresh process where importing any extra's module fails."""
    path = save_partitions(DataConfig(), 3, tmp_path)[0]
    out = subprocess.run([sys.executable, "-c", BLOCKED_ROUND, str(path), ",".join(EXTRA_MODULES)], cwd=REPO,
                         check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["loaded"] == []
    assert res["n"] == len(load_partition(DataConfig(), 0, 3))
    assert 0 < res["upload"] < 0.05 * 4 * sum(p.numel() for p in __import__("fedcomp.task.models").task.models
                                               .build_model().state_dict().values())
