"""Shaped links, measured: wall-clock time to 90 % accuracy of a real SuperLink + SuperNodes whose
links are shaped with ``tc`` (``benchmarks/netshape.py``), next to the computed
``round-seconds-simulated`` of ``metrics.json`` (does the computed round time match a real network?).

Each run: a bridge in the root network namespace holds the SuperLink (``flower-superlink
--insecure``, private ``FLWR_HOME`` and port); every SuperNode runs in its own network namespace
behind a veth pair shaped to ``uplink`` (client -> SuperLink) and ``downlink`` = 10 x uplink
(SuperLink -> client) megabits per second; ``flwr run . local-deployment`` submits the default
federation (digits, CNN) with the codec under test and the same link speeds as run config
(``uplink-mbps`` / ``downlink-mbps``, so the computed figures use the shaped speeds). The run is
stopped once the server's accuracy reaches the target (or after ``--max-rounds``).

Reported per run (see :func:`compare`):

- ``measured-seconds``: wall clock from the round-0 evaluation to the first round at the target
  (``elapsed-seconds`` in ``metrics.json``: the ServerApp's own clock);
- ``computed``: the sum of ``round-seconds-simulated`` over the same rounds, as fedcomp's model
  computes it now (:func:`current_model_seconds`), from the same run's client reports;
- ``breakdown`` per round: the train phase split into poll wait, download, ClientApp process,
  upload and server pick-up, from the stamped SuperNode logs and ``flower.log``; the link part
  (upload + download) is compared with bytes x 8 / speed after taking off the per-round floor that
  the same codec's transfers cost on its fastest link (:func:`link_floor`).

``--rtt-ms`` adds a round-trip time with :func:`netshape.relay` (``tc``'s netem is missing here).

Usage: ``sudo python benchmarks/links.py`` (root; writes ``benchmarks/results/links.json`` and
``docs/links.png``); ``--quick`` runs one codec at one speed for 2 rounds and writes to
``$TMPDIR/fedcomp-benchmarks/`` (never over the committed results). Every process is started by this
script and stopped by PID, the namespaces and veths are removed at the end (also on Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import pathlib
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

import netshape

from fedcomp.run.local_deployment import (Processes, superlink_command, supernode_command, wait_for_port,
                                          write_connection)
from fedcomp.strategies.round_metrics import FLOWER_POLL_SECONDS

CODECS = {  # name -> run config of the codec (defaults otherwise: error feedback on, density 1/100)
    "fp32": "compressor='none'",
    "sign": "compressor='sign'",
    "stc": "compressor='stc' density=0.01",
    "topk": "compressor='topk' density=0.01",
}
UPLINKS = (1.0, 10.0, 100.0)  # Mbit/s; downlink = DOWN_FACTOR x uplink
DOWN_FACTOR = 10.0
RELAY_PORT = 9190  # inside each client namespace (``--rtt-ms``)


class StampedProcesses(Processes):
    """:class:`fedcomp.run.local_deployment.Processes` whose logs carry a wall-clock stamp per line
    (``<unix seconds> <line>``): Flower's console lines have none, and the SuperNodes' lines
    "Receiving:" / "Received successfully" / "Sending:" / "Sent successfully" bracket each transfer."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[threading.Thread] = []

    def start(self, cmd: list[str], env: dict, log: pathlib.Path) -> subprocess.Popen:
        p = subprocess.Popen(cmd, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        t = threading.Thread(target=_stamp, args=(p.stdout, log), daemon=True)
        t.start()
        self.threads.append(t)
        return p

    def stop_all(self) -> None:
        super().stop_all()
        for t in self.threads:  # EOF once the process is gone
            t.join(10)


def _stamp(stream, log: pathlib.Path) -> None:
    with open(log, "w", encoding="utf-8", errors="replace") as fh:
        for raw in iter(stream.readline, b""):
            fh.write(f"{time.time():.3f} {raw.decode('utf-8', 'replace')}")
            fh.flush()


def _bin(name: str) -> str:
    here = pathlib.Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _rounds(path: pathlib.Path) -> list[dict]:
    try:
        return json.loads(path.read_text())["rounds"]
    except (OSError, ValueError, KeyError):
        return []


def run_one(codec: str, up: float | None, down: float | None, args, work: pathlib.Path) -> dict:
    """One shaped deployment run of ``codec``; ``up``/``down`` None = unshaped. Returns the run's row."""
    work.mkdir(parents=True, exist_ok=True)
    results = work / "results"
    procs = StampedProcesses()
    t_start = time.monotonic()
    with netshape.Topology(args.supernodes, up, down) as topo:
        port = _free_port(topo.host_ip)
        address = f"{topo.host_ip}:{port}"
        home = work / "flwr-home"
        write_connection(home, address)
        env = {**os.environ, "FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
               "PYTHONPATH": str(REPO),
               "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        nice = ["nice", "-n", str(args.nice)]
        try:
            link_cmd = superlink_command(host=topo.host_ip, port=port)
            link = procs.start([*nice, _bin(link_cmd[0]), *link_cmd[1:]], env, work / "superlink.log")
            wait_for_port(topo.host_ip, port, link, timeout=60)
            for i in range(args.supernodes):
                target = address
                if args.rtt_ms > 0:  # the SuperNode reaches the SuperLink through a delaying relay in its namespace
                    procs.start([*topo.exec_prefix(i), *nice, sys.executable, str(REPO / "benchmarks" / "netshape.py"),
                                 "relay", str(RELAY_PORT), topo.host_ip, str(port), str(args.rtt_ms)], env,
                                work / f"relay-{i}.log")
                    target = f"127.0.0.1:{RELAY_PORT}"
                # speeds as node config too: what the client reports is what the link is shaped to
                speeds = f"uplink-mbps={up or 1e6} downlink-mbps={down or 1e6}"
                cmd = supernode_command(i, args.supernodes, target, 9094, extra_node_config=speeds)
                procs.start([*topo.exec_prefix(i), *nice, _bin(cmd[0]), *cmd[1:]], env, work / f"supernode-{i}.log")
            run_config = (f"results-dir='{results}' num-server-rounds={args.max_rounds} min-available-nodes="
                          f"{args.supernodes} min-train-nodes={args.supernodes} partitioner='{args.partitioner}' "
                          f"{CODECS[codec]} {args.run_config}")
            submit = procs.start([_bin("flwr"), "run", str(REPO), "local-deployment", "--stream",
                                  "--run-config", run_config], env, work / "flwr-run.log")
            deadline = time.monotonic() + args.timeout
            reached = None
            while time.monotonic() < deadline and submit.poll() is None:  # bounded: deadline
                rounds = _rounds(results / "metrics.json")
                reached = next((r for r in rounds if r["round"] > 0 and r["accuracy"] >= args.target), None)
                if reached is not None:
                    break
                time.sleep(1.0)
            rounds = _rounds(results / "metrics.json")
            stats = topo.qdisc_stats()
        finally:
            procs.stop_all()
    nodes = [node_messages(work / f"supernode-{i}.log") for i in range(args.supernodes)]
    phases = server_train_phases(results / "flower.log") if (results / "flower.log").exists() else {}
    row = summarize(codec, up, down, rounds, args.target, time.monotonic() - t_start, stats)
    row["breakdown"] = round_breakdown(rounds, phases, nodes, up, down)
    row["netns-tag"] = topo.tag
    row["rtt-ms"] = args.rtt_ms
    first = [m for ms in nodes for m in ms[:1] if "t-received" in m]
    row["first-receive-seconds"] = [m["t-received"] - m["t-receiving"] for m in first]  # includes the FAB
    return row


EVENTS = (("Receiving: ", "t-receiving"), ("Received successfully", "t-received"),
          ("Start `flwr-clientapp` process", "t-clientapp"), ("Sending: ", "t-sending"),
          ("Sent successfully", "t-sent"))


def node_messages(log: pathlib.Path) -> list[dict]:
    """The messages one SuperNode handled, in order, from its stamped log: ``type`` ("train",
    "evaluate") and the unix times of the events in :data:`EVENTS` (a SuperNode handles one message
    at a time: receive, run a ClientApp process, send the reply)."""
    out: list[dict] = []
    for line in log.read_text(errors="replace").splitlines():
        stamp, _, text = line.partition(" ")
        for marker, key in EVENTS:
            if marker in text:
                if key == "t-receiving":
                    out.append({"type": text.split(marker, 1)[1].split()[0]})
                if out and key not in out[-1]:
                    out[-1][key] = float(stamp)
    return out


def server_train_phases(log: pathlib.Path) -> dict[int, tuple[float, float]]:
    """Round -> (unix time of ``configure_train``, of the train aggregation) from ``flower.log``
    (Flower's lines, stamped to the millisecond in local time)."""
    phases: dict[int, tuple[float, float]] = {}
    rnd, start = None, None
    for line in log.read_text(errors="replace").splitlines():
        parts = line.split(" ", 3)
        if len(parts) < 4:
            continue
        try:
            t = datetime.datetime.strptime(f"{parts[1]} {parts[2]}", "%Y-%m-%d %H:%M:%S,%f").timestamp()
        except ValueError:
            continue
        text = parts[3]
        if text.startswith("[ROUND "):
            rnd = int(text[7:].split("/")[0])
        elif text.startswith("configure_train:"):
            start = t
        elif "Aggregated MetricRecord" in text and "train-seconds" in text and rnd is not None and start is not None:
            phases[rnd] = (start, t)
            start = None
    return phases


def round_breakdown(rounds: list[dict], phases: dict, nodes: list[list[dict]], up, down) -> list[dict]:
    """Per round: the measured train phase split into poll wait, download, ClientApp, upload and
    server pick-up (the last node to finish sending), the measured transfer seconds (mean over
    nodes) and the computed ones (bytes per client x 8 / link speed)."""
    trains = [[m for m in ms if m["type"] == "train" and "t-sent" in m] for ms in nodes]
    out = []
    for r in rounds:
        k = r["round"]
        if k < 1 or k not in phases or any(len(t) < k for t in trains):
            continue
        t0, t1 = phases[k]
        msgs = [t[k - 1] for t in trains]
        last = max(msgs, key=lambda m: m["t-sent"])
        n = max(r.get("num-replies") or 1, 1)
        up_b, down_b = r["upload-bytes"] / n, r["download-bytes"] / n
        out.append({
            "round": k, "phase": t1 - t0, "poll": last["t-receiving"] - t0,
            "download": statistics.fmean(m["t-received"] - m["t-receiving"] for m in msgs),
            "upload": statistics.fmean(m["t-sent"] - m["t-sending"] for m in msgs),
            "clientapp": last["t-sending"] - last["t-received"],
            "pickup": t1 - last["t-sent"],
            "compute-reported": (r.get("train-seconds-max") or 0.0) + (r.get("compress-seconds") or 0.0),
            "clientapp-reported": r.get("clientapp-seconds-max") or 0.0,
            "download-computed": down_b * 8 / (down * 1e6) if down else 0.0,
            "upload-computed": up_b * 8 / (up * 1e6) if up else 0.0,
            "round-seconds-simulated": r.get("round-seconds-simulated"),
        })
    return out


def summarize(codec: str, up, down, rounds: list[dict], target: float, total: float, stats: dict) -> dict:
    """The row of one run from its ``metrics.json`` rounds (see the module docstring)."""
    r0 = next((r for r in rounds if r["round"] == 0), None)
    hit = next((r for r in rounds if r["round"] > 0 and r["accuracy"] >= target), None)
    last = hit or (rounds[-1] if rounds else None)
    upto = [r for r in rounds if 0 < r["round"] <= (last["round"] if last else 0)]
    per_round_measured = [b["elapsed-seconds"] - a["elapsed-seconds"] for a, b in itertools.pairwise(rounds)
                          if b["round"] <= (last["round"] if last else 0)]
    row = {
        "codec": codec, "uplink-mbps": up, "downlink-mbps": down, "target": target,
        "rounds-to-target": hit["round"] if hit else None,
        "rounds-run": len(upto),
        "measured-seconds": (last["elapsed-seconds"] - r0["elapsed-seconds"]) if (last and r0) else None,
        "computed-seconds": sum(r.get("round-seconds-simulated", 0.0) for r in upto),
        "round-measured-median": statistics.median(per_round_measured) if per_round_measured else None,
        "round-computed-median": statistics.median([r.get("round-seconds-simulated", 0.0) for r in upto])
        if upto else None,
        "compute-seconds-median": statistics.median([r.get("train-seconds-max", 0.0) + r.get("compress-seconds", 0.0)
                                                     for r in upto]) if upto else None,
        "upload-bytes-per-client": statistics.median([r["upload-bytes"] / max(r["num-replies"], 1) for r in upto])
        if upto else None,
        "download-bytes-per-client": statistics.median([r["download-bytes"] / max(r["num-replies"], 1)
                                                        for r in upto]) if upto else None,
        "final-accuracy": last["accuracy"] if last else None,
        "wall-seconds-total": total,
        "rounds": [{k: r.get(k) for k in ("round", "accuracy", "elapsed-seconds", "round-seconds-simulated",
                                          "train-seconds-max", "compress-seconds", "clientapp-seconds-max",
                                          "round-poll-seconds", "upload-bytes", "download-bytes",
                                          "federated-num-replies")} for r in rounds],
        "qdisc": stats,
    }
    return row


def current_model_seconds(row: dict) -> float:
    """Sum of ``round-seconds-simulated`` up to the target, as fedcomp computes it now: rows run
    before :data:`~fedcomp.strategies.round_metrics.FLOWER_POLL_SECONDS` entered the model (no
    ``round-poll-seconds`` in their rounds) get it added, from the same client reports."""
    last = row["rounds-to-target"] or row["rounds-run"]
    total = 0.0
    for r in row["rounds"]:
        if 0 < r["round"] <= last:
            total += r.get("round-seconds-simulated") or 0.0
            if r.get("round-poll-seconds") is None and (r.get("clientapp-seconds-max") or 0) > 0:
                total += FLOWER_POLL_SECONDS
    return total


def link_floor(rows: list[dict], codec: str) -> float | None:
    """Median seconds per round the transfers of ``codec`` take beyond bytes / speed on its fastest
    link (upload + download between the SuperNode's log lines): requests, serialisation, the object
    store; ``None`` without such a run."""
    runs = [r for r in rows if r["codec"] == codec and r.get("breakdown")]
    if not runs:
        return None
    fast = max(runs, key=lambda r: r["uplink-mbps"] or float("inf"))
    later = [x for x in fast["breakdown"] if x["round"] > 1] or fast["breakdown"]
    return statistics.median(x["upload"] + x["download"] - x["upload-computed"] - x["download-computed"]
                             for x in later)


def compare(row: dict, floor: float | None = None) -> dict:
    """Measured against computed for one run: the whole time to the target (``computed``: the model
    now, :func:`current_model_seconds`; ``old``: the model before this benchmark, reported compute +
    transfers) and the link part alone, from round 2 on (round 1 also fetches the app bundle):
    measured upload + download seconds (between the SuperNode's log lines) less ``floor`` per round
    (:func:`link_floor`) against bytes x 8 / speed. Ratios are measured / computed; the link ratio only where the
    computed link part is >= 1 s (below that the floor's noise, tenths of a second per round here, is larger than
    what is measured)."""
    b = row.get("breakdown") or []

    def ratio(m, c):
        return m / c if m is not None and c else None

    computed = current_model_seconds(row)
    old = sum(x["compute-reported"] + x["upload-computed"] + x["download-computed"] for x in b)
    later = [x for x in b if x["round"] > 1]  # round 1 also downloads the app bundle (FAB), once per run
    link_c = sum(x["upload-computed"] + x["download-computed"] for x in later)
    link_m = sum(x["upload"] + x["download"] for x in later) - (floor or 0.0) * len(later)
    return {"measured": row["measured-seconds"], "computed": computed,
            "ratio": ratio(row["measured-seconds"], computed), "old": old,
            "ratio-old": ratio(row["measured-seconds"], old), "link-measured": link_m, "link-computed": link_c,
            "ratio-link": ratio(link_m, link_c) if floor is not None and link_c >= 1.0 else None,
            "overhead-per-round": statistics.fmean(x["poll"] + x["pickup"] for x in b) if b else None}


def table(rows: list[dict]) -> str:
    """The docs' markdown table (docs/benchmarks/links.md) of a results file's rows."""
    def f(v, fmt="{:.1f}"):
        return "-" if v is None else fmt.format(v)

    lines = [("| codec | up / down Mbit/s | rounds to 90 % | measured s | computed s | ratio | old model s | ratio "
              "old | link part measured s | link part computed s | ratio link | poll wait s/round |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = compare(r, link_floor(rows, r["codec"]))
        speed = "unshaped" if r["uplink-mbps"] is None else f"{r['uplink-mbps']:g} / {r['downlink-mbps']:g}"
        if r.get("rtt-ms"):
            speed += f", RTT {r['rtt-ms']:g} ms"
        lines.append(f"| {r['codec']} | {speed} | {r['rounds-to-target'] or 'not in ' + str(r['rounds-run'])} | "
                     f"{f(c['measured'])} | {f(c['computed'])} | {f(c['ratio'], '{:.2f}')} | {f(c['old'])} | "
                     f"{f(c['ratio-old'], '{:.2f}')} | {f(c['link-measured'], '{:.2f}')} | "
                     f"{f(c['link-computed'], '{:.2f}')} | {f(c['ratio-link'], '{:.2f}')} | "
                     f"{f(c['overhead-per-round'])} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: pathlib.Path) -> None:
    """Left: measured against computed seconds to the target, one point per codec x speed (filled:
    the model now; hollow: before). Right: each round's upload + download seconds (round >= 2)
    measured against bytes x 8 / speed (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for codec, marker in zip(CODECS, "osD^"):
        rs = [r for r in rows if r["codec"] == codec and r["measured-seconds"]]
        cs = [compare(r) for r in rs]
        axes[0].scatter([c["computed"] for c in cs], [c["measured"] for c in cs], marker=marker, label=codec)
        axes[0].scatter([c["old"] for c in cs], [c["measured"] for c in cs], marker=marker, facecolors="none",
                        edgecolors="grey")
        for rtt in sorted({r.get("rtt-ms") or 0.0 for r in rs}):
            xs = [x for r in rs if (r.get("rtt-ms") or 0.0) == rtt for x in r["breakdown"] if x["round"] > 1]
            axes[1].scatter([x["upload-computed"] + x["download-computed"] for x in xs],
                            [x["upload"] + x["download"] for x in xs], marker=marker, s=14 if not rtt else 30,
                            label=codec + (f", RTT {rtt:g} ms" if rtt else ""),
                            **({"facecolors": "none", "edgecolors": "C3" if rtt > 100 else "C4"} if rtt else {}))
    lo, hi = axes[0].get_xlim()[0], max(axes[0].get_xlim()[1], axes[0].get_ylim()[1])
    axes[0].plot([lo, hi], [lo, hi], "k-", lw=0.8)
    axes[0].fill_between([lo, hi], [lo * 0.8, hi * 0.8], [lo * 1.2, hi * 1.2], color="grey", alpha=0.15,
                         label="+-20 %")
    axes[0].set_title("seconds to 90 % (filled: model now; hollow: compute + transfers only)", fontsize=9)
    hi = max(axes[1].get_xlim()[1], 0.1)
    floor = link_floor(rows, "fp32") or 0.0
    axes[1].plot([0, hi], [0, hi], "k-", lw=0.8, label="measured = computed")
    axes[1].plot([0, hi], [floor, hi + floor], "k--", lw=0.8, label=f"+ fp32 floor {floor:.2f} s")
    axes[1].set_title("per round: upload + download seconds (round >= 2)", fontsize=9)
    for ax in axes:
        ax.set_xlabel("computed (s)")
        ax.set_ylabel("measured (s)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--uplinks", default=",".join(str(u) for u in UPLINKS), help="Mbit/s; 0 = unshaped")
    ap.add_argument("--supernodes", type=int, default=2)
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--max-rounds", type=int, default=30)
    ap.add_argument("--partitioner", default="iid")
    ap.add_argument("--run-config", default="fraction-evaluate=0.0",
                    help="extra run config for every run (default: no federated evaluation phase)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run before it is stopped")
    ap.add_argument("--nice", type=int, default=0, help="niceness of the SuperLink and SuperNodes")
    ap.add_argument("--rtt-ms", type=float, default=0.0,
                    help="round-trip time added by a relay in each client namespace (netshape.relay); 0 = none")
    ap.add_argument("--quick", action="store_true", help="fp32 at 10 Mbit/s, 2 rounds, to $TMPDIR")
    ap.add_argument("--out", default="")
    ap.add_argument("--plot-only", default="", metavar="FILE", help="print the table and draw the figure of FILE")
    args = ap.parse_args(argv)
    if args.plot_only:
        src = pathlib.Path(args.plot_only)
        rows = json.loads(src.read_text())["rows"]
        print(table(rows))
        ref = src.resolve() == (REPO / "benchmarks" / "results" / "links.json").resolve()
        plot(rows, REPO / "docs" / "links.png" if ref else src.with_suffix(".png"))
        return 0
    def on_sigterm(signum, frame):  # the same clean-up as Ctrl-C: processes by PID, then namespaces
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    reason = netshape.unavailable()
    if reason:
        print(f"links: cannot shape links here: {reason}", flush=True)
        return 2
    if args.rtt_ms < 0:
        ap.error("--rtt-ms must be >= 0")
    if args.quick:
        args.codecs, args.uplinks, args.max_rounds, args.target = "fp32", "10", 2, 2.0
    out = pathlib.Path(args.out) if args.out else (
        pathlib.Path(tempfile.gettempdir()) / "fedcomp-benchmarks" / "links.json" if args.quick
        else REPO / "benchmarks" / "results" / "links.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    base = pathlib.Path(tempfile.mkdtemp(prefix="fedcomp-links-"))
    for codec in args.codecs.split(","):
        for u in (float(x) for x in args.uplinks.split(",")):
            up, down = (u, u * DOWN_FACTOR) if u > 0 else (None, None)
            print(f"links: {codec} up {up} down {down} Mbit/s ...", flush=True)
            row = run_one(codec, up, down, args, base / f"{codec}-{u:g}-rtt{args.rtt_ms:g}")
            rows.append(row)
            print(f"links: {codec} up {up}: rounds {row['rounds-to-target']} measured {row['measured-seconds']} s "
                  f"computed {row['computed-seconds']:.2f} s", flush=True)
            settings = {k: v for k, v in vars(args).items() if k not in ("out", "plot_only")}  # no paths
            out.write_text(json.dumps({"machine": platform.machine(), "load-avg": os.getloadavg(), "args": settings,
                                       "rows": rows}, indent=1))
    with contextlib.suppress(OSError):
        shutil.rmtree(base)
    print(table(rows))
    plot(rows, REPO / "docs" / "links.png" if out == REPO / "benchmarks" / "results" / "links.json"
         else out.with_suffix(".png"))
    print(f"links: results in {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
