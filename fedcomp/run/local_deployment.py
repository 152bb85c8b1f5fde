"""Local deployment launcher: a real ``flower-superlink`` and N ``flower-supernode`` processes on
127.0.0.1, then ``flwr run <app> local-deployment --stream``; every process it started is stopped
by PID afterwards, also when the run fails or is interrupted.

Run: ``fedcomp-local-deployment --supernodes 3 --run-config "num-server-rounds=5"`` (or
``python -m fedcomp.run.local_deployment``). The command lines come from `superlink_command` and
`supernode_command`, which ``docker-compose.yml`` mirrors (a test keeps them equal).
Flower 1.42: the SuperLink serves Fleet, Control and runtime APIs over HTTP on one port (8000);
each SuperNode's ClientApp runtime API needs its own port (9094, 9095, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

CONNECTION = "local-deployment"


def superlink_command(host: str = "127.0.0.1", port: int = 8000, database: str = ":flwr-in-memory:",
                      insecure: bool = True) -> list[str]:
    """``flower-superlink`` arguments (runtime dependency installation off)."""
    cmd = ["flower-superlink", "--host", host, "--port", str(port), "--database", database,
           "--disable-runtime-dependency-installation"]
    return cmd + (["--insecure"] if insecure else [])


def supernode_command(index: int, num: int, superlink: str = "127.0.0.1:8000", base_port: int = 9094,
                      host: str = "127.0.0.1", insecure: bool = True, extra_node_config: str = "") -> list[str]:
    """``flower-supernode`` arguments for partition ``index`` of ``num`` (runtime port base_port+index)."""
    node_config = f"partition-id={index} num-partitions={num}" + (f" {extra_node_config}" if extra_node_config else "")
    cmd = ["flower-supernode", "--superlink", superlink, "--host", host, "--port", str(base_port + index),
           "--node-config", node_config, "--max-retries", "10", "--max-wait-time", "60"]
    return cmd + (["--insecure"] if insecure else [])


def write_connection(flwr_home: pathlib.Path, address: str, insecure: bool = True) -> pathlib.Path:
    """Write ``$FLWR_HOME/config.toml`` with the ``local-deployment`` connection as default."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    path = flwr_home / "config.toml"
    path.write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = "{address}"\n'
        f"insecure = {'true' if insecure else 'false'}\n"
    )
    return path


def stop_local_superlink(flwr_home: pathlib.Path | str) -> list[int]:
    """SIGTERM the local SuperLink that ``flwr run`` started for this ``FLWR_HOME``, and only that one;
    returns the PIDs signalled.

    ``flwr run`` starts that SuperLink detached, so no launcher holds its PID: it is recognised by its
    command line, an own-user ``flower-superlink`` whose ``--log-file`` argument is exactly
    ``<flwr_home>/local-superlink/superlink.log`` (the whole argument compared, so the SuperLink of
    ``flwr-home-2`` never matches ``flwr-home``). Linux: read from ``/proc``; elsewhere nothing is
    signalled.
    """
    log = pathlib.Path(flwr_home) / "local-superlink" / "superlink.log"
    wanted = {str(log), str(log.resolve())}
    pids = [pid for pid, argv in _own_processes() if _is_superlink_logging_to(argv, wanted)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    return pids


def _own_processes() -> list[tuple[int, list[str]]]:
    """(PID, argv) of every process of this user readable in ``/proc`` (empty without ``/proc``)."""
    out = []
    for entry in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            raw = (entry / "cmdline").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        out.append((int(entry.name), raw.decode(errors="replace").split("\0")[:-1]))
    return out


def _is_superlink_logging_to(argv: list[str], wanted: set[str]) -> bool:
    """True if ``argv`` runs ``flower-superlink`` (directly or through its interpreter) with a
    ``--log-file`` argument equal to one of ``wanted``."""
    if not any(pathlib.PurePath(a).name == "flower-superlink" for a in argv[:2]):
        return False
    values = {b for a, b in zip(argv, argv[1:]) if a == "--log-file"}
    values |= {a.removeprefix("--log-file=") for a in argv if a.startswith("--log-file=")}
    return bool(values & wanted)


def port_is_free(host: str, port: int) -> bool:
    """True if nothing listens on ``host:port`` and we may bind it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR: a port in TIME_WAIT after a finished run is free; a listener still blocks bind
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def wait_for_port(host: str, port: int, proc: subprocess.Popen, timeout: float) -> None:
    """Block until ``host:port`` accepts connections.

    Raises
    ------
    RuntimeError
        If ``proc`` exits first or ``timeout`` seconds pass.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with code {proc.returncode} before listening on {host}:{port}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        time.sleep(0.2)
    raise RuntimeError(f"nothing listens on {host}:{port} after {timeout:.0f} s")


class Processes:
    """Processes started by the launcher; `stop_all` ends them by PID (TERM, then KILL)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], env: dict, log: pathlib.Path) -> subprocess.Popen:
        """Start ``cmd`` in its own process group with stdout/stderr to ``log``."""
        fh = open(log, "wb")  # noqa: SIM115 - closed with the process
        p = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen, grace: float = 10.0) -> None:
        """Stop one process group: SIGTERM, wait ``grace`` seconds, then SIGKILL."""
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)

    def stop_all(self) -> None:
        """Stop every process this object started, newest first."""
        for p in reversed(self.procs):
            self.stop(p)


def _bin(name: str) -> str:
    here = pathlib.Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def run(args: argparse.Namespace) -> int:
    """Start the topology, submit the run, wait for it, stop everything. Returns an exit code."""
    work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="fedcomp-deploy-")).resolve()
    flwr_home = work / "flwr-home"
    results = pathlib.Path(args.results_dir).resolve() if args.results_dir else work / "results"
    address = f"127.0.0.1:{args.port}"
    write_connection(flwr_home, address)
    env = {**os.environ, "FLWR_HOME": str(flwr_home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    procs = Processes()
    interrupted = failed = False
    metrics = results / "metrics.json"
    before = _stamp(metrics)  # an earlier run's file proves nothing about this one

    def on_signal(signum, frame):  # turn SIGTERM into the same clean-up as Ctrl-C
        raise KeyboardInterrupt

    for port in [args.port, *range(args.base_node_port, args.base_node_port + args.supernodes)]:
        if not port_is_free("127.0.0.1", port):
            print(f"fedcomp-deploy: port {port} on 127.0.0.1 is in use (another SuperLink/SuperNode?); "
                  "choose others with --port / --base-node-port", flush=True)
            return 2
    if not pathlib.Path(args.app, "pyproject.toml").is_file():
        print(f"fedcomp-deploy: {pathlib.Path(args.app).resolve()} is not a Flower app (no pyproject.toml)", flush=True)
        return 2
    old = signal.signal(signal.SIGTERM, on_signal)
    try:
        link = procs.start([_bin(superlink_command()[0]), *superlink_command(port=args.port)[1:]], env,
                           work / "superlink.log")
        wait_for_port("127.0.0.1", args.port, link, timeout=60)
        nodes = []
        wrappers, extra_cfg = _per_node(args.node_wrapper), _per_node(args.node_config)
        for i in range(args.supernodes):
            cmd = supernode_command(i, args.supernodes, address, args.base_node_port,
                                    extra_node_config=extra_cfg.get(i, ""))
            # a wrapped SuperNode (e.g. an emulated arm64 root file system) finds flower-supernode on its own PATH
            cmd = [*shlex.split(wrappers[i]), *cmd] if i in wrappers else [_bin(cmd[0]), *cmd[1:]]
            nodes.append(procs.start(cmd, env, work / f"supernode-{i}.log"))
        if link.poll() is not None:
            raise RuntimeError(f"the SuperLink exited (code {link.returncode}); see {work / 'superlink.log'}")
        waited = wait_for_supernodes(work / "superlink.log", args.supernodes, nodes, timeout=args.timeout)
        print(f"fedcomp-deploy: {args.supernodes} SuperNode(s) joined in {waited:.0f} s", flush=True)
        nodes_cfg = "".join(f"{k}={v} " for k, v in (("min-available-nodes", min(args.supernodes, 2)),
                                                      ("min-train-nodes", min(args.supernodes, 2)))
                            if k not in args.run_config)
        run_config = f"results-dir='{results}' " + nodes_cfg + args.run_config
        cmd = [_bin("flwr"), "run", str(pathlib.Path(args.app).resolve()), CONNECTION, "--stream",
               "--run-config", run_config]
        print(f"fedcomp-deploy: SuperLink pid {link.pid}, SuperNodes {[n.pid for n in nodes]}, logs in {work}",
              flush=True)
        submit = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  errors="replace")
        forward = threading.Thread(target=_forward, args=(submit.stdout,), daemon=True)
        forward.start()
        killed = False
        t0 = time.monotonic()
        deadline = t0 + args.timeout
        reported = -1
        while submit.poll() is None:
            if time.monotonic() > deadline:
                print(f"fedcomp-deploy: run exceeded {args.timeout} s, stopping", flush=True)
                submit.terminate()
                failed = True
                break
            done = _rounds_done(metrics, default=-1) if _stamp(metrics) != before else -1
            if done > reported:
                reported = done
                print(f"fedcomp-deploy: round {done} done, {time.monotonic() - t0:.0f} s elapsed", flush=True)
            if args.kill_supernode_after_round is not None and not killed and done >= args.kill_supernode_after_round:
                print(f"fedcomp-deploy: killing SuperNode 0 (pid {nodes[0].pid}) after round {done}", flush=True)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(nodes[0].pid, signal.SIGKILL)
                killed = True
            time.sleep(0.5)
        submit.wait(30)
        forward.join(10)
    except RuntimeError as e:  # a process that did not start or join: one line, then the clean-up below
        failed = True
        print(f"fedcomp-deploy: {e}", flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print("fedcomp-deploy: interrupted, stopping all processes", flush=True)
    finally:
        procs.stop_all()
        signal.signal(signal.SIGTERM, old)
    ok = not (failed or interrupted) and _stamp(metrics) not in (None, before) and _rounds_done(metrics) >= 1
    print(f"fedcomp-deploy: {'finished' if ok else 'FAILED'}; results in {results}", flush=True)
    return 130 if interrupted else (0 if ok else 1)


def _per_node(items: list[str] | None) -> dict[int, str]:
    """``["0=text", ...]`` (``--node-wrapper`` / ``--node-config``) as ``{0: "text"}``.

    Raises
    ------
    ValueError
        An item without ``INDEX=``.
    """
    out = {}
    for item in items or []:
        index, sep, text = item.partition("=")
        if not sep or not index.strip().isdigit():
            raise ValueError(f"expected INDEX=VALUE, got {item!r}")
        out[int(index)] = text
    return out


def _forward(stream) -> None:
    """Copy the submitting ``flwr run``'s output to our stdout, line by line."""
    for line in stream:
        print(line, end="", flush=True)


#: the SuperLink's log line when a SuperNode joins (Flower 1.42's Fleet API)
_ACTIVATED = re.compile(r"Activated node_id=(\d+)")


def wait_for_supernodes(log: pathlib.Path, count: int, nodes: list[subprocess.Popen], timeout: float) -> float:
    """Block until the SuperLink's log ``log`` names ``count`` distinct activated SuperNodes; returns the
    seconds waited.

    The launcher submits the run only then, so the first round samples every SuperNode it started while
    ``min-available-nodes`` stays at most 2: Flower waits for that minimum at *every* sampling, and a
    minimum equal to all nodes would hold the run forever once a dead node's heartbeat expires.

    Raises
    ------
    RuntimeError
        A SuperNode process exits first, or ``timeout`` seconds pass.
    """
    t0 = time.monotonic()
    while True:
        try:
            seen = set(_ACTIVATED.findall(log.read_text(errors="replace")))
        except OSError:
            seen = set()
        if len(seen) >= count:
            return time.monotonic() - t0
        for i, p in enumerate(nodes):
            if p.poll() is not None:
                raise RuntimeError(f"SuperNode {i} exited with code {p.returncode} before joining; see "
                                   f"{log.parent / f'supernode-{i}.log'}")
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"{len(seen)} of {count} SuperNodes joined the SuperLink in {timeout:.0f} s; "
                               f"see the supernode-*.log files in {log.parent}")
        time.sleep(0.5)


def _stamp(path: pathlib.Path) -> tuple[int, int, int] | None:
    """(inode, size, mtime in ns) of ``path``, or None if it does not exist: a results file rewritten
    by this run (atomically: a new inode) has another stamp than the one found before the run."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _rounds_done(path: pathlib.Path, default: int = 0) -> int:
    try:
        return max((r["round"] for r in json.loads(path.read_text())["rounds"]), default=default)
    except (OSError, ValueError, KeyError):
        return default


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point ``fedcomp-local-deployment``."""
    ap = argparse.ArgumentParser(description="Run fedcomp on a local SuperLink + SuperNodes (real processes).")
    ap.add_argument("--supernodes", type=int, default=2)
    ap.add_argument("--app", default=".", help="Flower app directory (default: current directory)")
    ap.add_argument("--run-config", default="", help='extra run config, e.g. "num-server-rounds=5 compressor=\'sign\'"')
    ap.add_argument("--port", type=int, default=8000, help="SuperLink HTTP port")
    ap.add_argument("--base-node-port", type=int, default=9094, help="first SuperNode runtime port")
    ap.add_argument("--results-dir", default="", help="absolute results folder (default: <workdir>/results)")
    ap.add_argument("--workdir", default="", help="FLWR_HOME, logs and results live here (default: a temp dir)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds before the run is stopped")
    ap.add_argument("--node-wrapper", action="append", metavar="INDEX=COMMAND",
                    help="run SuperNode INDEX through COMMAND, e.g. 0='scripts/arm64_rootfs.sh exec build/arm64-root'")
    ap.add_argument("--node-config", action="append", metavar="INDEX=CONFIG",
                    help="extra node config of SuperNode INDEX, e.g. 0=\"data-file='/data/partition-0.npz'\"")
    ap.add_argument("--kill-supernode-after-round", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.supernodes < 1:
        ap.error("--supernodes must be >= 1")
    ports = [args.port, *range(args.base_node_port, args.base_node_port + args.supernodes)]
    if not all(1 <= p <= 65535 for p in ports):
        ap.error("ports must be in 1..65535")
    if len(set(ports)) != len(ports):
        ap.error(f"--port {args.port} collides with the SuperNode ports {ports[1:]}")
    if "results-dir" in args.run_config:
        ap.error("set the results folder with --results-dir, not in --run-config")
    if "'" in (args.results_dir + args.workdir):
        ap.error("--results-dir/--workdir must not contain an apostrophe")
    for key in ("min-available-nodes", "min-train-nodes"):
        for tok in args.run_config.split():
            if (tok.startswith(key + "=") and tok.split("=", 1)[1].isdigit()
                    and int(tok.split("=", 1)[1]) > args.supernodes):
                ap.error(f"{tok} exceeds --supernodes {args.supernodes}: the run would wait forever")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
