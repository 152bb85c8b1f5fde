"""`flwr run` on a private local SuperLink for the end-to-end tests: its own FLWR_HOME and ports (so a
SuperLink another process left running is never reused), stopped by PID afterwards."""

import os
import pathlib
import shutil
import socket
import subprocess
import sys

from fedcomp.run.local_deployment import stop_local_superlink

REPO = pathlib.Path(__file__).resolve().parents[1]
#: the ports of fedcomp's own app run (other apps' tests pass their own, so runs never share a SuperLink)
PORTS = ("39391", "39393")


def _port_free(port: str) -> bool:
    """Whether nothing listens on 127.0.0.1:``port`` (a bind succeeds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", int(port)))
        except OSError:
            return False
    return True


def free_ports(n: int) -> tuple[str, ...]:
    """``n`` ports free right now on 127.0.0.1 (the system hands them out)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return tuple(str(s.getsockname()[1]) for s in socks)
    finally:
        for s in socks:
            s.close()


def _free_ports(ports: tuple[str, str]) -> tuple[str, str]:
    """``ports`` when both are free, else two `free_ports`: a SuperLink another process runs on a test's
    fixed port (a user's, another test run's) is never reused."""
    return ports if all(_port_free(p) for p in ports) else free_ports(len(ports))


def flwr_env(tmp_path: pathlib.Path, ports: tuple[str, str] = PORTS) -> dict:
    """The environment of a `flwr run` in ``tmp_path``: FLWR_HOME there, the SuperLink's HTTP and Control
    API on ``ports`` (or two free ones where something listens on them), no runtime dependency
    installation, this interpreter's scripts first on PATH."""
    ports = _free_ports(ports)
    env = dict(os.environ)
    env["FLWR_HOME"] = str(tmp_path / "flwr-home")
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"], env["FLWR_LOCAL_CONTROL_API_PORT"] = ports
    return env


def flwr_run_app(app_dir: pathlib.Path, tmp_path: pathlib.Path, nodes: int, run_config: str,
                 ports: tuple[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`flwr run app_dir --stream` on ``nodes`` simulated SuperNodes (one CPU each) with ``run_config``;
    the local SuperLink is stopped afterwards. `flwr run` exits 0 even when the run failed: callers
    judge by the results file."""
    env = flwr_env(tmp_path, ports)
    flwr = shutil.which("flwr", path=env["PATH"])
    cmd = [flwr] if flwr else [sys.executable, "-m", "flwr.cli.app"]
    cmd += ["run", str(app_dir), "--stream", "--federation-config",
            f"num-supernodes={nodes} client-resources-num-cpus=1", "--run-config", run_config]
    try:
        return subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout,
                              check=False)
    finally:
        stop_local_superlink(tmp_path / "flwr-home")


def fedcomp_run(tmp_path: pathlib.Path, nodes: int, run_config: str, ports: tuple[str, str] = PORTS,
                wrapper: bool = False) -> tuple[str, pathlib.Path, int]:
    """fedcomp's own app by `flwr run .`, or with ``wrapper`` by `fedcomp-simulation` (which runs it), with
    results in ``tmp_path/results``: (log, metrics.json path, exit code)."""
    results = tmp_path / "results"
    overrides = f"{run_config} results-dir='{results}'"
    if wrapper:
        cmd = [sys.executable, "-m", "fedcomp.run.simulation", "--app", str(REPO), "--supernodes", str(nodes),
               "--run-config", overrides]
        try:
            proc = subprocess.run(cmd, env=flwr_env(tmp_path, ports), cwd=tmp_path, capture_output=True, text=True,
                                  timeout=400)
        finally:
            stop_local_superlink(tmp_path / "flwr-home")
    else:
        proc = flwr_run_app(REPO, tmp_path, nodes, overrides, ports, timeout=400)
    return proc.stdout + proc.stderr, results / "metrics.json", proc.returncode


def flwr_run(tmp_path: pathlib.Path, nodes: int, run_config: str,
             ports: tuple[str, str] = PORTS) -> tuple[str, pathlib.Path]:
    """`flwr run .` of fedcomp's own app: (log, metrics.json path); judge the run by the results file."""
    log, metrics, _ = fedcomp_run(tmp_path, nodes, run_config, ports)
    return log, metrics
