"""Device-sized SuperNodes: the lean SuperNode image in containers with a Raspberry Pi's memory.

For every model and codec, a real SuperLink on this machine and two SuperNode containers of the
``supernode`` image (``docker run --network host --cpus 1``), one with ``--memory 1g`` (Pi 4
class) and one with ``--memory 512m`` (Pi Zero 2 class), swap off (``--memory-swap`` = the limit),
each training on its own partition file, run a few rounds (``fedcomp-local-deployment``). Reported
per container: the rounds its client completed, the ClientApp's peak RSS as the client reported it
(``client-peak-rss`` in metrics.json, MiB, the process's ``VmHWM``), the container's peak memory
as its cgroup counted it (every process in it: flower-supernode, SuperExec, ClientApp; page cache
included), out-of-memory kills in it, and the failures the server logged for it.

Needs a Docker engine and the image (``docker build --target supernode -t fedcomp-supernode .``,
see docs/benchmarks/device-memory.md). Run: ``python benchmarks/device_memory.py [--models cnn resnet] [--codecs
stc sign topk] [--rounds 2]``; prints a table and writes ``benchmarks/results/device_memory.json``
(``--quick``: cnn/stc, 1 round, written to the temporary folder).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

from outputs import REPO, output_path, shown

#: Containers: (name suffix, docker memory limit, device class).
LIMITS = (("1g", "1g", "Pi 4 class"), ("512m", "512m", "Pi Zero 2 class"))
CGROUP_V1 = pathlib.Path("/sys/fs/cgroup/memory/docker")


def _cgroup_dir(cid: str) -> tuple[pathlib.Path, int]:
    """A container's memory cgroup folder and its version (1 or 2; systemd or cgroupfs driver)."""
    if (CGROUP_V1 / cid).is_dir():
        return CGROUP_V1 / cid, 1
    for base in (pathlib.Path(f"/sys/fs/cgroup/system.slice/docker-{cid}.scope"),
                 pathlib.Path(f"/sys/fs/cgroup/docker/{cid}")):
        if base.is_dir():
            return base, 2
    return pathlib.Path("/nonexistent"), 0


def _stat(path: pathlib.Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except (OSError, ValueError):
        pass
    return 0


def _proc_mb(pid: str) -> tuple[str, float, float]:
    """(program name, VmHWM MiB, RssAnon MiB) of a process, from /proc."""
    try:
        argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        status = pathlib.Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return "", 0.0, 0.0
    prog = next((pathlib.Path(a.decode(errors="replace")).name for a in argv[:2]
                 if a and not pathlib.Path(a.decode(errors="replace")).name.startswith("python")), "?")
    kb = {line.split(":")[0]: int(line.split()[1]) for line in status if line.startswith(("VmHWM", "RssAnon"))}
    return prog, kb.get("VmHWM", 0) / 1024, kb.get("RssAnon", 0) / 1024


class ContainerWatch(threading.Thread):
    """Polls the cgroup of container ``name`` every 0.5 s while it lives: peak bytes (page cache
    included), peak anonymous bytes (the processes' own memory), OOM kills, and each program's
    largest VmHWM / RssAnon (flower-supernode, flower-superexec, flwr-clientapp)."""

    def __init__(self, name: str) -> None:
        super().__init__(daemon=True)
        self.name, self.peak, self.anon, self.oom, self.stop = name, 0, 0, 0, threading.Event()
        self.programs: dict[str, dict[str, float]] = {}

    def run(self) -> None:
        base, version = None, 0
        while not self.stop.is_set():
            if base is None:
                cid = subprocess.run(["docker", "inspect", "-f", "{{.Id}}", self.name], capture_output=True,
                                     check=False, text=True).stdout.strip()
                base, version = _cgroup_dir(cid) if cid else (None, 0)
            if version:
                peak = base / ("memory.max_usage_in_bytes" if version == 1 else "memory.peak")
                try:
                    self.peak = max(self.peak, int(peak.read_text()))
                except (OSError, ValueError):
                    pass
                self.anon = max(self.anon, _stat(base / "memory.stat", "total_rss" if version == 1 else "anon"))
                self.oom = max(self.oom, _stat(base / ("memory.oom_control" if version == 1 else "memory.events"),
                                               "oom_kill"))
                try:
                    pids = (base / "cgroup.procs").read_text().split()
                except OSError:
                    pids = []
                for pid in pids:
                    prog, hwm, anon = _proc_mb(pid)
                    if prog:
                        p = self.programs.setdefault(prog, {"vmhwm-mb": 0.0, "rss-anon-mb": 0.0})
                        p["vmhwm-mb"], p["rss-anon-mb"] = max(p["vmhwm-mb"], hwm), max(p["rss-anon-mb"], anon)
            self.stop.wait(0.5)


def run_one(model: str, codec: str, rounds: int, image: str, parts: pathlib.Path, work: pathlib.Path,
            port: int) -> list[dict]:
    """One federation (2 capped SuperNodes); one row per container."""
    names = [f"fedcomp-mem-{os.getpid()}-{suffix}" for suffix, _, _ in LIMITS]
    cmd = [sys.executable, "-m", "fedcomp.run.local_deployment", "--supernodes", "2", "--port", str(port),
           "--base-node-port", str(port + 1), "--workdir", str(work), "--timeout", "1500", "--run-config",
           f"num-server-rounds={rounds} compressor='{codec}' model='{model}' min-train-nodes=2"]
    for i, (suffix, mem, _) in enumerate(LIMITS):
        cmd += ["--node-wrapper", (f"{i}=docker run --rm --name {names[i]} --network host --cpus 1 --memory {mem} "
                f"--memory-swap {mem} -v {parts}:/data:ro --entrypoint '' {image}"),
                "--node-config", f"{i}=data-file='/data/partition-{i}.npz'"]
    watches = [ContainerWatch(n) for n in names]
    for w in watches:
        w.start()
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - t0
    for w in watches:
        w.stop.set()
        w.join(5)
    for n in names:  # a container left over by an interrupted run
        subprocess.run(["docker", "rm", "-f", n], capture_output=True, check=False)
    try:
        recs = json.loads((work / "results" / "metrics.json").read_text())["rounds"]
    except (OSError, ValueError, KeyError):
        recs = []
    recs = [r for r in recs if r.get("round", 0) >= 1]
    rows = []
    for i, (suffix, mem, device) in enumerate(LIMITS):
        limit_mb = {"1g": 1024.0, "512m": 512.0}[mem]
        nodes = {n for r in recs for n, v in r.get("client-memory-limit", {}).items() if v == limit_mb}
        peaks = [v for r in recs for n, v in r.get("client-peak-rss", {}).items() if n in nodes]
        fails = [{"round": r["round"], **f} for r in recs for f in r.get("failures", [])
                 if str(f["node"]) in nodes or not nodes]
        rows.append({"model": model, "codec": codec, "memory": mem, "device": device, "rounds": rounds,
                     "rounds-completed": sum(1 for r in recs if any(n in nodes for n in r.get("client-peak-rss", {}))),
                     "client-peak-rss-mb": max(peaks, default=None), "container-peak-mb": watches[i].peak / 2**20,
                     "container-anon-peak-mb": watches[i].anon / 2**20, "programs": watches[i].programs,
                     "oom-kills": watches[i].oom, "failures": fails, "run-seconds": seconds,
                     "deploy-exit-code": proc.returncode})
    # what the server said about failed clients and out-of-memory kills (the run's log)
    said = [line.split("fedcomp-deploy")[0].strip() for line in proc.stdout.splitlines()
            if "failed" in line and "node" in line or "out-of-memory" in line]
    for row in rows:
        row["server-log"] = said
    if not recs:
        print(proc.stdout[-3000:], proc.stderr[-2000:], file=sys.stderr)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["cnn", "resnet"])
    ap.add_argument("--codecs", nargs="+", default=["stc", "sign", "topk"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--image", default="fedcomp-supernode")
    ap.add_argument("--port", type=int, default=18600, help="SuperLink port; the SuperNodes take the next two")
    ap.add_argument("--quick", action="store_true", help="cnn/stc, 1 round, to the temporary folder")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.models, args.codecs, args.rounds = ["cnn"], ["stc"], 1
    out = output_path("device_memory", args.out, args.quick)
    with tempfile.TemporaryDirectory(prefix="fedcomp-devmem-") as tmp:
        parts = pathlib.Path(tmp) / "parts"
        subprocess.run([sys.executable, "-m", "fedcomp.task.datafiles", "--num-partitions", "2", "--out", str(parts)],
                       cwd=REPO, check=True, capture_output=True)
        os.chmod(tmp, 0o755)
        rows = []
        print(f"{'model':<7} {'codec':<5} {'memory':<6} {'rounds':>6} {'client peak RSS MB':>18} "
              f"{'container peak MB':>17} {'OOM kills':>9}  failures")
        for model in args.models:
            for codec in args.codecs:
                for r in run_one(model, codec, args.rounds, args.image, parts, pathlib.Path(tmp) / f"{model}-{codec}",
                                 args.port):
                    rows.append(r)
                    peak = "-" if r["client-peak-rss-mb"] is None else f"{r['client-peak-rss-mb']:.0f}"
                    why = "; ".join(f"round {f['round']}: {f['error']}" for f in r["failures"]) or "none"
                    print(f"{model:<7} {codec:<5} {r['memory']:<6} {r['rounds-completed']:>3}/{r['rounds']:<2} "
                          f"{peak:>18} {r['container-peak-mb']:>17.0f} {r['oom-kills']:>9}  {why}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"image": args.image, "rows": rows}, indent=1))
    print(f"wrote {shown(out)}")


if __name__ == "__main__":
    main()
