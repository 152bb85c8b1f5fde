"""Deployment: compose files mirror the launcher; the launcher runs a real SuperLink + SuperNodes."""

import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from fedcomp.run.local_deployment import main as deploy_main
from fedcomp.run.local_deployment import superlink_command, supernode_command, write_connection

from .helpers import free_port_block, run_launcher

REPO = pathlib.Path(__file__).resolve().parents[2]


def compose(*files):
    merged: dict = {}
    for f in files:
        doc = yaml.safe_load((REPO / f).read_text())
        for name, svc in doc["services"].items():
            merged.setdefault(name, {}).update(svc)
    return merged


def test_compose_commands_equal_the_launcher():
    svc = compose("docker-compose.yml")
    assert svc["superlink"]["command"] == superlink_command(host="0.0.0.0")
    for i in range(3):
        assert svc[f"supernode-{i}"]["command"] == supernode_command(i, 3, "superlink:8000", host="0.0.0.0")
    sub = svc["submit"]["command"]
    run = 'flwr run . local-deployment --stream --run-config "$$RUN_CONFIG"'
    assert sub[:2] == ["sh", "-c"] and sub[2].count(run) == 1
    # depends_on waits only for the SuperLink's container: submit first waits (bounded) for its port
    wait = "until python -c \"import socket; socket.create_connection(('superlink', 8000), 2).close()\""
    assert sub[2].startswith("i=0; " + wait) and "[ $$i -ge 240 ] && break" in sub[2]
    assert sub[2].index(wait) < sub[2].index(run)
    # `flwr run` exits 0 on a failed run: submit judges by the ServerApp's last line
    assert "grep -q 'fedcomp  results written to'" in sub[2] and "exit 1" in sub[2]
    assert "./results:/results" in svc["superlink"]["volumes"]


def test_tls_override_only_swaps_insecure_for_certificates():
    svc = compose("docker-compose.yml", "docker-compose.tls.yml")
    link = svc["superlink"]["command"]
    assert "--insecure" not in link and link[:link.index("--ssl-ca-certfile")] == superlink_command(
        host="0.0.0.0", insecure=False)
    assert link[-1] == "--enable-supernode-auth"
    for i in range(3):
        cmd = svc[f"supernode-{i}"]["command"]
        assert cmd[:-4] == supernode_command(i, 3, "superlink:8000", host="0.0.0.0", insecure=False)
        assert cmd[-4:] == ["--root-certificates", "/certs/ca.crt", "--auth-supernode-private-key",
                            f"/run/fedcomp/keys/supernode-{i}"]
        # each SuperNode sees only its own private key, the register service only public keys
        assert [v for v in svc[f"supernode-{i}"]["volumes"] if "/keys/" in v] == [
            f"./keys/supernode-{i}:/secrets/keys/supernode-{i}:ro"]
    assert all(v.endswith(".pub:ro") for v in svc["register"]["volumes"] if "/keys/" in v)
    assert not any("ca.key" in v for s in svc.values() for v in s.get("volumes", []))


def _has_compose_v2() -> bool:
    return shutil.which("docker") is not None and subprocess.run(
        ["docker", "compose", "version"], capture_output=True).returncode == 0


@pytest.mark.parametrize("tool", [
    pytest.param(["docker-compose"], id="v1", marks=pytest.mark.skipif(
        shutil.which("docker-compose") is None, reason="docker-compose v1 (Debian package) not installed")),
    pytest.param(["docker", "compose"], id="v2", marks=pytest.mark.skipif(
        not _has_compose_v2(), reason="the docker compose v2 plugin is not installed")),
])
@pytest.mark.parametrize("files", [["docker-compose.yml"], ["docker-compose.yml", "docker-compose.tls.yml"]])
def test_compose_files_validate(tool, files):
    args = [a for f in files for a in ("-f", f)]
    out = subprocess.run([*tool, *args, "config", "-q"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_dockerfile_runs_as_non_root():
    text = (REPO / "Dockerfile").read_text()
    assert "\nUSER app" in text and "torch==2.13.0" in text
    # the entrypoint never execs the command as root: it drops privileges first
    entry = (REPO / "scripts" / "docker-entrypoint.sh").read_text()
    assert 'exec setpriv --reuid="$uid"' in entry and entry.count('exec "$@"') == 1


@pytest.mark.parametrize("files", [["docker-compose.yml"], ["docker-compose.yml", "docker-compose.tls.yml"]])
def test_one_image_built_once(files):
    svc = compose(*files)
    assert [name for name, s in svc.items() if "build" in s] == ["superlink"]
    assert {s["image"] for s in svc.values()} == {"${FEDCOMP_IMAGE:-fedcomp:latest}"}
    assert all(s["pull_policy"] == "never" for s in svc.values())


def test_image_requirements_core_and_extras_without_ray():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from image_requirements import image_requirements
    finally:
        sys.path.pop(0)
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = image_requirements(str(REPO / "pyproject.toml"))  # the lean `supernode` image
    assert core == project["dependencies"]
    full = image_requirements(str(REPO / "pyproject.toml"), ("simulation", "dp"))  # self-references expanded
    extras = project["optional-dependencies"]
    assert full[:len(core)] == core and len(set(full)) == len(full)
    assert set(full) == set(core + extras["data"] + extras["plots"] + extras["dp"])
    assert not any("simulation" in r or r.startswith("fedcomp") for r in full)
    with pytest.raises(KeyError):
        image_requirements(str(REPO / "pyproject.toml"), ("nope",))


def _strip_libs():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import strip_libs
    finally:
        sys.path.pop(0)
    return strip_libs


@pytest.mark.skipif(shutil.which("strip") is None, reason="binutils' strip is not installed")
def test_strip_libs_strips_what_still_loads_and_restores_the_rest(tmp_path, monkeypatch):
    """scripts/strip_libs.py (the lean image's -131 MB): a real extension module loses its symbol table and
    still loads; a file strip cannot read, and one that would not load after stripping (numpy's
    patchelf'd OpenBLAS in the image: "ELF load command address/offset not page-aligned"), stay
    byte-identical; non-ELF files and links are not touched."""
    import ctypes

    import yaml._yaml as cyaml

    mod = _strip_libs()
    good = tmp_path / "a" / pathlib.Path(cyaml.__file__).name
    good.parent.mkdir()
    shutil.copy2(cyaml.__file__, good)
    before = good.stat().st_size
    bad = tmp_path / "libbad.so.1"
    bad.write_bytes(b"\x7fELF" + bytes(range(256)) * 4)
    (tmp_path / "notes.so.txt").write_text("not a library")
    (tmp_path / "link.so").symlink_to(good)
    n, saved, kept = mod.strip_tree(tmp_path)
    assert n == 1 and kept == ["libbad.so.1"]
    assert saved == before - good.stat().st_size > 0
    ctypes.CDLL(str(good))
    assert bad.read_bytes() == b"\x7fELF" + bytes(range(256)) * 4
    assert (tmp_path / "notes.so.txt").read_text() == "not a library"
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(["a", good.name, "libbad.so.1", "notes.so.txt",
                                                                  "link.so"])

    # a library that no longer loads once stripped gets its original bytes back
    fresh = tmp_path / "b" / good.name
    fresh.parent.mkdir()
    shutil.copy2(cyaml.__file__, fresh)
    original = fresh.read_bytes()
    monkeypatch.setattr(mod, "_loads", lambda path: False)
    n, saved, kept = mod.strip_tree(fresh.parent)
    assert (n, saved, kept) == (0, 0, [good.name]) and fresh.read_bytes() == original


def test_dockerignore_keeps_the_context_small():
    lines = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines() if ln.strip()
             and not ln.startswith("#")]
    assert lines[0] == "*"  # allow-list: .venv, results, certs, keys, caches never enter the context
    assert {"!fedcomp/", "!fedcomp_app/", "!pyproject.toml", "!wheels/torch-*.whl",
            "!scripts/strip_libs.py"} <= set(lines)


@pytest.mark.slow
def test_launcher_two_supernodes_two_rounds(tmp_path, capsys):
    code, out = run_launcher(tmp_path, capsys, "--supernodes", "2", "--run-config",
                             "num-server-rounds=2 compressor='stc' density=0.05")
    data = json.loads((tmp_path / "results" / "metrics.json").read_text())
    assert code == 0, out[-2000:]
    rounds = data["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert all(r["num-replies"] == 2 and r["upload-bytes"] == r["upload-bytes-stc"] > 0 for r in rounds[1:])
    assert all(r["client-machines"] == {platform.machine(): 2} and r["client-peak-rss-mb"] > 50 for r in rounds[1:])
    # feedback while it runs: one line per round with the elapsed time
    assert [int(m) for m in re.findall(r"fedcomp-deploy: round (\d+) done, \d+ s elapsed", out)] == [0, 1, 2]
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in rounds)
    # every process started was stopped
    assert subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True).stdout == b""


@pytest.mark.slow
def test_bad_run_config_fails_at_once_with_one_line(tmp_path, capsys):
    t0 = time.monotonic()
    code, out = run_launcher(tmp_path, capsys, "--supernodes", "1", "--run-config", "density=2.0")
    assert code == 1  # no results: the launcher says FAILED although `flwr run` exited 0
    lines = [ln for ln in out.splitlines() if "run config 'density'" in ln]
    assert len(lines) == 1 and "must be in (0.0, 1.0], got 2.0" in lines[0], out[-3000:]
    assert "Traceback" not in out and "fedcomp-deploy: FAILED" in out
    assert time.monotonic() - t0 < 120


@pytest.mark.slow
def test_killed_supernode_does_not_stop_the_run(tmp_path, capsys):
    code, out = run_launcher(tmp_path, capsys, "--supernodes", "3", "--kill-supernode-after-round", "1",
                             "--run-config", "num-server-rounds=2 compressor='sign' round-timeout=45.0")
    assert "killing SuperNode 0" in out
    # the launcher waited for all three, then asked for at most two: a dead node's expired heartbeat
    # used to hold round 2's evaluation sampling until the launcher's timeout (CI, flwr 1.42)
    assert "fedcomp-deploy: 3 SuperNode(s) joined in" in out and "run exceeded" not in out
    data = json.loads((tmp_path / "results" / "metrics.json").read_text())
    assert data["run-config"]["min-available-nodes"] == 2
    assert code == 0, out[-2000:]
    rounds = data["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert rounds[1]["num-replies"] == 3
    assert rounds[2]["num-replies"] == 2  # the dead node's reply is missing or an error, the others aggregate
    assert rounds[2]["accuracy"] > 0.0


@pytest.mark.slow
def test_wrong_address_fails_fast_with_a_clear_message(tmp_path):
    home = tmp_path / "home"
    write_connection(home, "127.0.0.1:1")
    env = {**os.environ, "FLWR_HOME": str(home),
           "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    t0 = time.monotonic()
    out = subprocess.run(["flwr", "run", str(REPO), "local-deployment", "--stream"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert time.monotonic() - t0 < 60
    assert out.returncode != 0
    assert "unavailable" in (out.stdout + out.stderr)


def test_launcher_refuses_a_port_in_use_and_a_missing_app(tmp_path, capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        assert deploy_main(["--app", str(REPO), "--port", str(busy), "--workdir", str(tmp_path)]) == 2
        assert f"port {busy} on 127.0.0.1 is in use" in capsys.readouterr().out
    base = free_port_block(3)
    assert deploy_main(["--app", str(tmp_path), "--port", str(base), "--base-node-port", str(base + 1),
                        "--workdir", str(tmp_path)]) == 2
    assert "is not a Flower app" in capsys.readouterr().out


@pytest.mark.parametrize("argv,msg", [
    (["--port", "70000"], "1..65535"), (["--port", "18000", "--base-node-port", "17999", "--supernodes", "2"],
                                        "collides"),
    (["--run-config", "results-dir='/x'"], "--results-dir"), (["--workdir", "/tmp/it's"], "apostrophe"),
    (["--supernodes", "2", "--run-config", "min-available-nodes=5"], "exceeds --supernodes"),
])
def test_launcher_argument_errors(argv, msg, capsys):
    with pytest.raises(SystemExit):
        deploy_main(["--app", str(REPO), *argv])
    assert msg in capsys.readouterr().err


def test_wait_for_supernodes_counts_distinct_activations_and_names_a_dead_node(tmp_path):
    from fedcomp.run.local_deployment import wait_for_supernodes

    log = tmp_path / "superlink.log"
    line = "INFO :      [Fleet.ActivateNode] Activated node_id={}\n"
    log.write_text(line.format(11) + line.format(11) + line.format(22))
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert wait_for_supernodes(log, 2, [alive], timeout=5) < 1.0
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"^2 of 3 SuperNodes joined the SuperLink in 1 s"):
            wait_for_supernodes(log, 3, [alive], timeout=1)  # node 11 activated twice counts once
        assert time.monotonic() - t0 < 5
    finally:
        alive.kill()
        alive.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait()
    try:
        with pytest.raises(RuntimeError, match=r"^SuperNode 1 exited with code 3 before joining; see "
                                               r".*supernode-1\.log$"):
            wait_for_supernodes(log, 3, [alive, dead], timeout=60)
    finally:
        alive.kill()
        alive.wait()
