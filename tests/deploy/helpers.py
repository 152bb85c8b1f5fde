"""Plain helpers for the deployment tests: free ports, the local launcher, and what the Docker Compose
tests say about the engine and a failed image build."""

from __future__ import annotations

import os
import pathlib
import random

from fedcomp.run.local_deployment import main as deploy_main
from fedcomp.run.local_deployment import port_is_free

REPO = pathlib.Path(__file__).resolve().parents[2]


def free_port_block(n: int) -> int:
    """First of ``n`` consecutive ports that are free on 127.0.0.1 now (random start, retried)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000 - n)
        if all(port_is_free("127.0.0.1", base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports found")


def run_launcher(tmp_path, capsys, *extra):
    """`fedcomp-local-deployment` on five free ports in ``tmp_path`` with ``extra`` arguments: (exit code, output)."""
    base = free_port_block(5)  # SuperLink at base, SuperNodes from base + 1: every port the launcher binds
    code = deploy_main(["--app", str(REPO), "--port", str(base), "--base-node-port", str(base + 1),
                        "--workdir", str(tmp_path), "--timeout", "400", *extra])
    out = capsys.readouterr().out
    return code, out


def engine_script() -> pathlib.Path | None:
    """The shared engine script, or None."""
    for cand in (os.environ.get("FEDCOMP_DOCKER_ENGINE"), REPO.parent / "shared" / "tools" / "docker-engine.sh"):
        if cand and pathlib.Path(cand).is_file():
            return pathlib.Path(cand)
    return None


#: the image the Dockerfile builds from (the engine script builds a local stand-in: nothing is pulled)
BASE_IMAGE = "python:3.11-slim"


def build_failure(log: str) -> str:
    """One line saying why an image build failed: the missing base image, the missing torch wheel,
    or the build's last error line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    if any(BASE_IMAGE in ln and ("pull" in ln or "not found" in ln or "resolve" in ln) for ln in lines):
        return (f"the base image {BASE_IMAGE} is missing and cannot be pulled: build the local stand-in with "
                "docker-engine.sh start")
    if any("torch" in ln and ("No matching distribution" in ln or "Could not find" in ln) for ln in lines):
        return "no torch 2.13.0 wheel reached the build: put one in wheels/ (TORCH_WHEELS)"
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or ["no output"])[-1][:300]
