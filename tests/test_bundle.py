"""The app bundle (FAB) `flwr run` sends carries only the app's entry points; the library is installed.

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

#: Flower 1.42 stores the FAB's files uncompressed. The bundle carries the app's entry points
#: (``fedcomp_app/``), ``pyproject.toml`` and ``LICENSE``; the library is installed where it runs.
#: Before: 1.92 MB (README, benchmarks/results, docs, examples, tests), then 0.95 MB (all of fedcomp/).
MAX_FAB_BYTES = 400_000
APP_FILES = {"fedcomp_app/__init__.py", "fedcomp_app/server_app.py", "fedcomp_app/client_app.py"}


def _names(fab: bytes) -> list[str]:
    return zipfile.ZipFile(io.BytesIO(fab)).namelist()


def test_the_bundle_is_the_app_only():
    from flwr.cli.build import build_fab_from_disk

    fab = build_fab_from_disk(REPO)
    assert len(fab) <= MAX_FAB_BYTES, len(fab)
    assert sorted(_names(fab)) == sorted(APP_FILES | {"pyproject.toml", "LICENSE", ".info/CONTENT"})


def _python(code: str, *args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_bundle_runs_the_installed_library(tmp_path):
    """What a SuperNode unpacks loads: the ServerApp and ClientApp components of pyproject.toml come
    from the unpacked bundle, first on ``sys.path`` as Flower puts it, and fedcomp from the install."""
    from flwr.cli.build import build_fab_from_disk

    zipfile.ZipFile(io.BytesIO(build_fab_from_disk(REPO))).extractall(tmp_path)
    code = ("import sys, tomllib, importlib; sys.path.insert(0, sys.argv[1]); "
            "comps = tomllib.load(open(sys.argv[1] + '/pyproject.toml', 'rb'))['tool']['flwr']['app']['components']; "
            "mods = [importlib.import_module(c.split(':')[0]) for c in comps.values()]; "
            "assert all(m.__file__.startswith(sys.argv[1]) for m in mods), [m.__file__ for m in mods]; "
            "import fedcomp; assert not fedcomp.__file__.startswith(sys.argv[1]), fedcomp.__file__; "
            "print(sorted(type(getattr(m, c.split(':')[1])).__name__ for m, c in zip(mods, comps.values())))")
    out = _python(code, str(tmp_path), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "['ClientApp', 'ServerApp']"


def _app_package():
    """``fedcomp_app`` from the repository (it is the bundle, not part of the installed library)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fedcomp_app", REPO / "fedcomp_app" / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_bundle_names_its_release():
    import tomllib

    import fedcomp

    fedcomp_app = _app_package()
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert fedcomp_app.BUILT_WITH == fedcomp.__version__ == version


@pytest.mark.parametrize("setup, expected", [
    ("import fedcomp; fedcomp.__version__ = '9.9.9'",
     "this app bundle was built with fedcomp {v}, but this machine has fedcomp 9.9.9"),
    ("sys.modules['fedcomp'] = None",
     "this Flower app needs the fedcomp library, which is not installed here: install fedcomp {v}"),
])
def test_a_machine_without_the_bundles_release_is_refused(tmp_path, setup, expected):
    fedcomp_app = _app_package()
    code = (f"import sys; sys.path.insert(0, sys.argv[1]); {setup}\n"
            "try:\n    import fedcomp_app.client_app\nexcept ImportError as exc:\n    print(exc)\n"
            "else:\n    print('loaded')")
    out = _python(code, str(REPO), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith(expected.format(v=fedcomp_app.BUILT_WITH)), out.stdout
    assert "pip install -c constraints.txt ." in out.stdout


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
    assert set(_names(fab.read_bytes())) >= APP_FILES
