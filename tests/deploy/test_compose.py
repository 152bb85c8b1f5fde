"""`docker compose up` on a real Docker engine: plain and TLS + SuperNode authentication.

The engine is started with the shared ``docker-engine.sh`` (``$FEDCOMP_DOCKER_ENGINE``, or
``../shared/tools/docker-engine.sh`` next to the repository) and stopped again if this module
started it. The image is built once (plain run, torch from a local wheel folder filled by
``pip download``) and reused by the TLS run. Without an engine the tests skip with the reason,
unless ``FEDCOMP_REQUIRE_DOCKER=1`` (CI), where that is a failure. Deselect locally with
``pytest -m "not docker"``.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import pytest

from .helpers import BASE_IMAGE, build_failure, engine_script

REPO = pathlib.Path(__file__).resolve().parents[2]
ROUNDS = 3  # the defaults (STC 0.01 up, 0.05 down, seeded start): 3 clients get from ~10 % to ~50 % in 3 rounds
pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]

#: what the build context and the compose files need (copied into a private project folder)
PROJECT_FILES = ["Dockerfile", ".dockerignore", "docker-compose.yml", "docker-compose.tls.yml", "pyproject.toml",
                 "constraints.txt", "README.md", "LICENSE", "fedcomp", "fedcomp_app", "scripts", "deploy"]


def _docker_ok() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


def _unavailable(reason: str):
    if os.environ.get("FEDCOMP_REQUIRE_DOCKER") == "1":
        pytest.fail(f"FEDCOMP_REQUIRE_DOCKER=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def engine():
    """A running Docker engine with `docker compose` (v2); stopped afterwards if started here."""
    started = None
    if not _docker_ok():
        script = engine_script()
        if script is None:
            _unavailable("no Docker engine running and no docker-engine.sh to start one "
                         "(set FEDCOMP_DOCKER_ENGINE to its path)")
        if os.geteuid() != 0:
            _unavailable("starting the Docker engine needs root")
        out = subprocess.run(["bash", str(script), "start"], capture_output=True, text=True, timeout=1200)
        if out.returncode != 0 or not _docker_ok():
            _unavailable(f"the Docker engine did not start: {(out.stdout + out.stderr)[-1500:]}")
        started = script
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        _unavailable("`docker compose` (v2 plugin) is not installed")
    yield
    if started is not None:
        subprocess.run(["bash", str(started), "stop"], capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def project(engine, tmp_path_factory):
    """A private copy of the compose project, a private image tag, torch from a local wheel."""
    root = tmp_path_factory.mktemp("compose")
    for name in PROJECT_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, root / name)
    if subprocess.run(["docker", "image", "inspect", BASE_IMAGE], capture_output=True).returncode != 0:
        _unavailable(f"the engine has no {BASE_IMAGE} image and nothing can be pulled here: build the local "
                     "stand-in with docker-engine.sh start (see its header)")
    wheels = REPO / "wheels"
    if list(wheels.glob("torch-2.13.0*.whl")):
        shutil.copytree(wheels, root / "wheels")
    else:
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "torch==2.13.0", "-d",
                              str(root / "wheels")], capture_output=True, text=True, timeout=900)
        if got.returncode != 0:
            _unavailable("no torch 2.13.0 wheel for the image: put one in wheels/ "
                         "(pip download --no-deps torch==2.13.0 -d wheels/ where the index is reachable)")
    image = f"fedcomp-test:{os.getpid()}"
    env = {**os.environ, "FEDCOMP_IMAGE": image, "TORCH_WHEELS": "wheels/", "FEDCOMP_PORT": str(_free_port()),
           "FEDCOMP_RUN_CONFIG": f"num-server-rounds={ROUNDS}",
           "COMPOSE_PROJECT_NAME": f"fedcomp-test-{os.getpid()}"}
    # the one build of this module (the plain test's `up --build` finds it cached; TLS reuses it)
    out = subprocess.run(["docker", "compose", "build"], cwd=root, env=env, capture_output=True, text=True,
                         timeout=1500)
    if out.returncode != 0:
        log = root / "build.log"
        log.write_text(out.stdout + out.stderr)
        pytest.fail(f"`docker compose build` failed: {build_failure(out.stdout + out.stderr)} (full log: {log})",
                    pytrace=False)
    yield root, env
    subprocess.run(["docker", "image", "rm", "-f", image], capture_output=True, timeout=300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _compose_up(root: pathlib.Path, env: dict, files: list[str], build: bool) -> subprocess.CompletedProcess:
    args = [a for f in files for a in ("-f", f)]
    up = ["docker", "compose", *args, "up", *(["--build"] if build else []), "--abort-on-container-exit",
          "--exit-code-from", "submit"]
    try:
        return subprocess.run(up, cwd=root, env=env, capture_output=True, text=True, timeout=1500)
    finally:
        subprocess.run(["docker", "compose", *args, "down", "--remove-orphans", "--timeout", "5"], cwd=root, env=env,
                       capture_output=True, timeout=300)


def _check_results(results: pathlib.Path, log: str, owner: int) -> list[dict]:
    metrics = results / "metrics.json"
    assert metrics.is_file(), log[-4000:]
    rounds = json.loads(metrics.read_text())["rounds"]
    assert [r["round"] for r in rounds] == list(range(ROUNDS + 1)), log[-4000:]
    assert rounds[-1]["accuracy"] > rounds[0]["accuracy"] + 0.1, [r["accuracy"] for r in rounds]
    for r in rounds[1:]:
        assert r["num-replies"] == 3
        # STC at density 0.01: ~0.1 bit per parameter against 32 bits dense (ratio ~300)
        assert 0 < r["upload-bytes"] == r["upload-bytes-stc"] < r["dense-bytes"] / 200
    assert (results / "plot.png").stat().st_size > 1000
    # written by the uid that owns ./results, never by root
    assert metrics.stat().st_uid == owner and (results / "plot.png").stat().st_uid == owner
    assert "fedcomp  results written to /results" in log
    return rounds


def test_compose_up_runs_the_federation_and_writes_results(project):
    root, env = project
    # ./results does not exist: Docker creates it as root, the entrypoint hands it to uid 1000
    out = _compose_up(root, env, ["docker-compose.yml"], build=True)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    _check_results(root / "results", log, owner=1000)
    assert "Permission denied" not in log


def test_compose_tls_with_supernode_authentication(project):
    root, env = project
    shutil.rmtree(root / "results", ignore_errors=True)
    (root / "results").mkdir()
    os.chown(root / "results", 4242, 4242)  # a host user without an account in the image
    for script, arg in (("generate_certs.sh", "certs"), ("generate_supernode_keys.sh", "keys")):
        subprocess.run(["bash", str(root / "scripts" / script), arg], cwd=root, check=True, capture_output=True)
    out = _compose_up(root, env, ["docker-compose.yml", "docker-compose.tls.yml"], build=False)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    _check_results(root / "results", log, owner=4242)
    assert log.count("registered successfully") == 3
    assert "--insecure" not in log


def test_submit_exits_nonzero_when_the_run_fails(project):
    """`flwr run` exits 0 on a failed run; the submit service turns that into exit code 1."""
    root, env = project
    bad = {**env, "FEDCOMP_RUN_CONFIG": "num-server-rounds=1 density=2.0"}
    out = _compose_up(root, bad, ["docker-compose.yml"], build=False)
    log = out.stdout + out.stderr
    assert out.returncode == 1, log[-4000:]
    assert "run config 'density' must be in (0" in log and "submit: the run FAILED" in log
    assert "Traceback" not in log  # one line naming the key, the traceback only at DEBUG


def test_plain_docker_run_refuses_an_unwritable_results_folder(project, tmp_path):
    """Started as the image's user (no `user: root`), the entrypoint checks ./results and says why."""
    _, env = project
    folder = tmp_path / "not-yours"
    folder.mkdir()
    folder.chmod(0o755)
    owner = folder.stat().st_uid
    if owner == 1000:
        pytest.skip("the folder belongs to uid 1000, the image's user")
    out = subprocess.run(["docker", "run", "--rm", "-v", f"{folder}:/results", env["FEDCOMP_IMAGE"], "true"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 73, out.stdout + out.stderr
    assert f"the results folder /results is not writable by uid 1000 (owner uid {owner})" in out.stderr


LEAN_ROUND = r"""
import json, platform, sys, time
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, Metadata, RecordDict
from fedcomp.app.client_app import app
from fedcomp.task.models import build_model
absent = []
for m in ("ray", "matplotlib", "sklearn", "scipy", "opacus", "flwr_datasets", "datasets", "pandas", "pyarrow", "pip"):
    try:
        __import__(m)
    except ModuleNotFoundError:
        absent.append(m)
md = Metadata(run_id=1, message_id="m1", src_node_id=1, dst_node_id=7, reply_to_message_id="", group_id="1",
              created_at=time.time(), ttl=3600.0, message_type="train")
msg = Message(content=RecordDict({"arrays": ArrayRecord(build_model().state_dict()),
                                  "config": ConfigRecord({"compressor": "stc", "server-round": 1})}), metadata=md)
ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 2,
                                               "data-file": "/data/partition-0.npz"}, state=RecordDict(), run_config={})
reply = app(msg, ctx)
assert not reply.has_error(), reply.error
upload = sum(len(a.data) for a in reply.content["arrays"].values())  # the payloads (the server counts them)
print(json.dumps({"absent": absent, "upload": float(upload),
                  "machine": reply.content["fedcomp.client-info"]["machine"]}))
"""


def test_supernode_image_is_lean_and_trains_on_a_partition_file(project, tmp_path):
    """`docker build --target supernode`: the core only, under 1 GB here (0.96 GB measured, its libraries
    stripped by scripts/strip_libs.py), and a ClientApp train round runs in it on a mounted partition file."""
    from fedcomp.task.data import DataConfig
    from fedcomp.task.datafiles import save_partitions

    root, _ = project
    tag = f"fedcomp-supernode-test:{os.getpid()}"
    out = subprocess.run(["docker", "build", "--target", "supernode", "-t", tag, "--build-arg", "TORCH_WHEELS=wheels/",
                          "."], cwd=root, capture_output=True, text=True, timeout=1500, check=False)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    try:
        size = int(subprocess.run(["docker", "image", "inspect", "-f", "{{.Size}}", tag], capture_output=True,
                                  text=True, check=True).stdout)
        assert size < 1.0e9, size
        save_partitions(DataConfig(), 2, tmp_path)
        tmp_path.chmod(0o755)
        for f in tmp_path.iterdir():
            f.chmod(0o644)
        run = subprocess.run(["docker", "run", "--rm", "--network", "none", "-v", f"{tmp_path}:/data:ro",
                              "--entrypoint", "python", tag, "-c", LEAN_ROUND], capture_output=True, text=True,
                             timeout=600, check=False)
        assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
        res = json.loads(run.stdout.strip().splitlines()[-1])
        assert sorted(res["absent"]) == sorted(["ray", "matplotlib", "sklearn", "scipy", "opacus", "flwr_datasets",
                                                "datasets", "pandas", "pyarrow", "pip"])
        assert res["upload"] > 0 and res["machine"] == "x86_64"
    finally:
        subprocess.run(["docker", "image", "rm", "-f", tag], capture_output=True, timeout=300, check=False)


def test_compose_up_with_secure_aggregation_alone(project):
    """``secagg = true`` and nothing else: Flower's SecAgg+ across the 3 SuperNode containers, with the
    secure setting it resolves to (shared-seed random-k, rotation, few quantization bits)."""
    from fedcomp.config.secagg import SECURE_CODEC, SECURE_QUANTIZATION

    root, env = project
    shutil.rmtree(root / "results", ignore_errors=True)
    out = _compose_up(root, {**env, "FEDCOMP_RUN_CONFIG": f"num-server-rounds={ROUNDS} secagg=true"},
                      ["docker-compose.yml"], build=False)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    data = json.loads((root / "results" / "metrics.json").read_text())
    rounds = data["rounds"]
    assert [r["round"] for r in rounds] == list(range(ROUNDS + 1)), log[-4000:]
    assert data["codec"].startswith("secagg+ shared randomk")
    k = round(38282 * SECURE_CODEC["density"])  # float entries of the default CNN
    m = math.ceil(math.log2(3 * (1 << SECURE_QUANTIZATION["secagg-quantization-bits"]) + 1))  # 3 clients' sum
    for r in rounds[1:]:
        # k values + the weight entry, m bits each, 15-byte headers
        assert r["num-replies"] == 3 and r["k"] == k and r["modulus-bits"] == m, r
        assert r["upload-bytes"] == 3 * (15 + (k * m + 7) // 8 + 15 + (m + 7) // 8)
        assert r["secagg-protocol-bytes"] > 0
    # it trains, slowly at first (7 % of the rotated update per round; error feedback carries the rest)
    assert rounds[-1]["loss"] < rounds[0]["loss"] - 0.004, [(r["loss"], r["accuracy"]) for r in rounds]
    assert "secagg = true with compressor at its default" in log
    assert "fedcomp  results written to /results" in log
