"""The app bundle (FAB) `flwr run` sends carries only what the SuperLink and the SuperNodes run.

Built with Flower's own builder (``flwr.cli.build.build_fab_from_disk``, what ``flwr build`` calls),
so the ``fab-include`` rule of ``[tool.flwr.app]`` is read exactly as Flower reads it.
"""

from __future__ import annotations

import io
import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

#: Flower 1.42 stores the FAB's files uncompressed, so the bundle is at least fedcomp's own code (0.91 MB
#: of Python when this was written). Before the ``fab-include`` rule the bundle was 1.92 MB (README,
#: benchmarks/results, docs, examples, tests); the cap leaves room for the code to grow.
MAX_FAB_BYTES = 1_200_000
#: what the bundle may add to the code it carries: pyproject.toml, the CONTENT manifest, zip headers
OVERHEAD_BYTES = 48_000


def _code_bytes() -> int:
    return sum(p.stat().st_size for p in (REPO / "fedcomp").rglob("*.py")
               if "__pycache__" not in p.parts) + (REPO / "LICENSE").stat().st_size


def _names(fab: bytes) -> list[str]:
    return zipfile.ZipFile(io.BytesIO(fab)).namelist()


def test_the_bundle_is_the_code_only():
    from flwr.cli.build import build_fab_from_disk

    fab = build_fab_from_disk(REPO)
    names = _names(fab)
    assert len(fab) <= min(MAX_FAB_BYTES, _code_bytes() + OVERHEAD_BYTES), (len(fab), _code_bytes())
    assert {"fedcomp/app/server_app.py", "fedcomp/app/client_app.py", "fedcomp/client/mod.py",
            "fedcomp/compression/wire.py", "pyproject.toml", "LICENSE"} <= set(names)
    others = [n for n in names
              if not n.startswith("fedcomp/") and n not in ("pyproject.toml", "LICENSE", ".info/CONTENT")]
    assert others == []


def test_the_bundle_alone_loads_the_apps(tmp_path):
    """What a SuperNode unpacks is enough: the ServerApp and ClientApp components of pyproject.toml
    load from the unpacked bundle alone, first on ``sys.path`` as Flower puts it."""
    from flwr.cli.build import build_fab_from_disk

    zipfile.ZipFile(io.BytesIO(build_fab_from_disk(REPO))).extractall(tmp_path)
    code = ("import sys, tomllib, importlib; sys.path.insert(0, sys.argv[1]); "
            "comps = tomllib.load(open(sys.argv[1] + '/pyproject.toml', 'rb'))['tool']['flwr']['app']['components']; "
            "mods = [importlib.import_module(c.split(':')[0]) for c in comps.values()]; "
            "assert all(m.__file__.startswith(sys.argv[1]) for m in mods), [m.__file__ for m in mods]; "
            "print(sorted(type(getattr(m, c.split(':')[1])).__name__ for m, c in zip(mods, comps.values())))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "['ClientApp', 'ServerApp']"


def test_stray_files_in_the_folder_stay_out_of_the_bundle():
    """Generated models (``lora-base/``), results folders, docs and figures never travel."""
    from flwr.cli.build import build_fab_from_files
    from flwr.cli.utils import collect_files

    files: dict[str, bytes | pathlib.Path] = dict(collect_files(REPO))
    files.update({"lora-base/config.json": b"{}", "lora-base/model.safetensors.json": b"{}",
                  "results/run/metrics.json": b"{}", "site/index.md": b"# x\n", "notes.md": b"# x\n"})
    names = _names(build_fab_from_files(files)[0])
    assert not [n for n in names if n.split("/")[0] in ("lora-base", "results", "site", "docs", "benchmarks",
                                                           "tests", "examples", "README.md", "notes.md")]


@pytest.mark.slow
def test_flwr_build_writes_a_bundle_within_the_bound(tmp_path):
    """The command a user runs: ``flwr build --app <repo>`` (the app folder's name must be a valid
    Flower project name, so the repo's files are copied into ``fedcomp/`` first)."""
    app = tmp_path / "fedcomp"
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "--cached", "--others", "--exclude-standard"],
                            check=True, capture_output=True, text=True).stdout.splitlines()
    for rel in listed:
        src = REPO / rel
        if src.is_file():
            (app / rel).parent.mkdir(parents=True, exist_ok=True)
            (app / rel).write_bytes(src.read_bytes())
    flwr = pathlib.Path(sys.executable).parent / "flwr"
    out = subprocess.run([str(flwr), "build", "--app", str(app)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    (fab,) = tmp_path.glob("*.fab")
    assert fab.stat().st_size <= MAX_FAB_BYTES
    assert "fedcomp/client/mod.py" in _names(fab.read_bytes())
