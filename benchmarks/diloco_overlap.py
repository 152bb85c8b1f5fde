"""Streaming DiLoCo with and without overlapping communication: utilisation measured over a shaped link.

Two workers, each in its own Linux network namespace joined by a bridge (``benchmarks/netshape.py``'s
``Topology``: a ``tbf`` qdisc on each end of each worker's veth pair, 100 Mbit/s each way unless
``--mbps``), train the example's character-level GPT (``examples/diloco/train.py``) on their halves of
the Shakespeare plays (or the digits CNN, ``--task digits``) with AdamW and
:class:`fedcomp.distributed.DiLoCo`, gloo over the shaped link (``GLOO_SOCKET_IFNAME``: the worker's
veth), one thread each. Every side runs the same inner steps from the same start:

- ``diloco``: one fragment, each exchange blocks its ``step()`` (``overlap_steps=0``);
- ``diloco-overlap``: one fragment, each exchange overlapped with the next ``--overlap`` inner steps;
- ``streaming``: ``--fragments`` fragments at staggered steps, blocking;
- ``streaming-overlap``: the same fragments, each exchange overlapped with the next ``--overlap``
  inner steps (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication").

Measured per worker: the wall-clock seconds from a barrier before the first inner step to the last
outer update applied (``DiLoCo.flush()``), and the compute seconds (forward, backward and the inner
optimizer's step, timed around them); utilisation = compute / wall. Also the seconds ``step()`` was
blocked (``DiLoCo.sync_seconds``), the bytes each worker handed to the collectives, the bytes each
shaped interface passed (``tc -s qdisc``: Ethernet/IP/TCP headers included), the held-out loss after
the run (not timed) and the machine's load average before and after each side. For the figures to
say something a fragment's transfer must be comparable to the compute between two fragment syncs:
the JSON records both (the transfer computed from the bytes at the link's rate, the compute measured).
Each side runs ``--repeats`` times (2 by default: every side, then every side in the reverse order,
so that a change of the machine's speed during the run weighs on every side alike); a side's row
holds the means and every run under ``repeats``.

Needs root, ``ip`` and ``tc`` (``netshape.unavailable()`` says what is missing)::

    sudo python benchmarks/diloco_overlap.py            # 4-6 minutes on 2 cores
    sudo python benchmarks/diloco_overlap.py --quick    # a small model, 2 sides; into a temporary folder

``--quick`` checks the script; its results go to ``--out`` (a temporary file by default) and never
into ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import pathlib
import re
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "diloco" / "train.py"
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO / "benchmarks"))

import netshape  # noqa: E402 - benchmarks/ is not a package


def load_example():
    """The example module (model, data), imported from its file."""
    spec = importlib.util.spec_from_file_location("diloco_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sides(fragments: int, overlap: int, quick: bool) -> list[dict]:
    """The configurations compared (name, F, tau)."""
    streaming = [{"name": "streaming", "fragments": fragments, "overlap_steps": 0},
                 {"name": "streaming-overlap", "fragments": fragments, "overlap_steps": overlap}]
    if quick:
        return streaming
    return [{"name": "diloco", "fragments": 1, "overlap_steps": 0},
            {"name": "diloco-overlap", "fragments": 1, "overlap_steps": overlap}, *streaming]


# -- one worker (runs inside its namespace) ----------------------------------------------------------

def worker(cfg: dict) -> None:
    """Train one side as rank ``cfg["rank"]``; write its figures to ``cfg["out"]`` (JSON)."""
    import torch
    import torch.distributed as dist

    from fedcomp.distributed import DiLoCo

    torch.set_num_threads(1)
    rank, world, side = cfg["rank"], cfg["world_size"], cfg["side"]
    dist.init_process_group("gloo", init_method=f"tcp://{cfg['master']}:{cfg['port']}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=cfg["timeout"]))
    ex = load_example()
    args = ex.parse_args(["--task", cfg["task"], "--batch-size", str(cfg["batch_size"]), "--dim", str(cfg["dim"]),
                          "--layers", str(cfg["layers"]), "--seq-len", str(cfg["seq_len"]),
                          "--eval-batches", str(cfg["eval_batches"])])
    task = (ex.TextTask if cfg["task"] == "gpt" else ex.DigitsTask)(args, rank, world)
    task.gen = torch.Generator().manual_seed(1 + rank)
    torch.manual_seed(0)
    model = (ex.TinyGPT(len(task.stoi), cfg["seq_len"], dim=cfg["dim"], layers=cfg["layers"])
             if cfg["task"] == "gpt" else ex.SmallCNN())
    inner = torch.optim.AdamW(model.parameters(), lr=cfg["inner_lr"], weight_decay=0.01)
    lr, momentum = cfg["outer_lr"], cfg["outer_momentum"]
    outer = DiLoCo(model, inner, compressor=cfg["compressor"], sync_every=cfg["sync_every"],
                   fragments=side["fragments"], overlap_steps=side["overlap_steps"],
                   outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=lr, momentum=momentum, nesterov=momentum > 0))
    dist.barrier()
    compute = 0.0
    began = time.perf_counter()
    for _ in range(cfg["steps"]):
        x, y = task.batch()
        t0 = time.perf_counter()
        task.loss(model(x), y).backward()
        inner.step()
        inner.zero_grad(set_to_none=True)
        compute += time.perf_counter() - t0
        outer.step()
    outer.flush()
    wall = time.perf_counter() - began
    loss = ex.evaluate(model, task, torch.device("cpu"))
    sizes = [sum(outer.params[i].numel() for i in g) for g in outer.groups]
    result = {"rank": rank, "wall_seconds": wall, "compute_seconds": compute, "utilisation": compute / wall,
              "blocked_seconds": outer.sync_seconds, "bytes_sent": outer.bytes.sent, "final_loss": loss,
              "outer_steps": outer.outer_steps, "parameters": sum(p.numel() for p in model.parameters()),
              "fragment_entries": sizes}
    pathlib.Path(cfg["out"]).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# -- the parent (root namespace) ---------------------------------------------------------------------

def _qdisc_bytes(topo) -> dict[str, int]:
    """Bytes each shaped interface has passed so far (``up-i``: worker i's egress, ``down-i``: into it)."""
    out = {}
    for key, text in topo.qdisc_stats().items():
        m = re.search(r"Sent (\d+) bytes", text)
        out[key] = int(m.group(1)) if m else 0
    return out


def run_side(topo, cfg: dict, side: dict, port: int, tmp: pathlib.Path) -> dict:
    """Both workers of one side, each in its namespace; their figures and the link's bytes."""
    before, load_before = _qdisc_bytes(topo), os.getloadavg()
    tmp.mkdir(parents=True, exist_ok=True)
    argvs, outs, logs = [], [], []
    for rank in range(2):
        out, log = tmp / f"{side['name']}-{rank}.json", tmp / f"{side['name']}-{rank}.log"
        spec = {**cfg, "side": side, "rank": rank, "world_size": 2, "master": topo.client_ips[0], "port": port,
                "out": str(out)}
        spec_file = tmp / f"{side['name']}-{rank}-config.json"
        spec_file.write_text(json.dumps(spec))
        argvs.append([sys.executable, str(pathlib.Path(__file__)), "--worker", str(spec_file)])
        outs.append(out)
        logs.append(log)
    codes = topo.run_ranks(argvs, logs, cfg["timeout"] * 4)
    if any(codes) or not all(o.is_file() for o in outs):
        sys.exit(f"side {side['name']} failed:\n{topo.log_tails(codes, logs)}")
    after = _qdisc_bytes(topo)
    workers = [json.loads(o.read_text()) for o in outs]
    params = workers[0]["parameters"]
    steps, h, f = cfg["steps"], cfg["sync_every"], side["fragments"]
    per_step = sum(w["compute_seconds"] for w in workers) / (2 * steps)
    largest = max(workers[0]["fragment_entries"])
    return {
        **side, "workers": workers,
        "utilisation": sum(w["utilisation"] for w in workers) / 2,
        "utilisation_min": min(w["utilisation"] for w in workers),
        "wall_seconds": max(w["wall_seconds"] for w in workers),
        "compute_seconds": sum(w["compute_seconds"] for w in workers) / 2,
        "blocked_seconds": sum(w["blocked_seconds"] for w in workers) / 2,
        "final_loss": sum(w["final_loss"] for w in workers) / 2,
        "bytes_per_worker": workers[0]["bytes_sent"], "parameters": params,
        "compute_per_step_seconds": per_step,
        # the largest fragment's fp32 bytes at the link's rate, against the compute between its syncs
        "fragment_bytes": 4 * largest,
        "fragment_link_seconds_computed": 4 * largest * 8 / (cfg["mbps"] * 1e6),
        "compute_between_fragment_syncs_seconds": per_step * h / f,
        "wire_bytes": {k: after[k] - before.get(k, 0) for k in sorted(after)},
        "load_before": list(load_before), "load_after": list(os.getloadavg()),
    }


def combine(repeats: list[dict]) -> dict:
    """One side's row from its repeats: their means (``utilisation_min``: the lowest worker of any),
    every repeat kept under ``repeats``."""
    first = repeats[0]
    mean = {k: sum(r[k] for r in repeats) / len(repeats)
            for k in ("utilisation", "wall_seconds", "compute_seconds", "blocked_seconds", "final_loss",
                      "compute_per_step_seconds", "compute_between_fragment_syncs_seconds")}
    return {"name": first["name"], "fragments": first["fragments"], "overlap_steps": first["overlap_steps"], **mean,
            "utilisation_each": [r["utilisation"] for r in repeats],
            "utilisation_min": min(r["utilisation_min"] for r in repeats),
            **{k: first[k] for k in ("bytes_per_worker", "parameters", "fragment_bytes",
                                     "fragment_link_seconds_computed")},
            "repeats": repeats}


def table(rows: list[dict], mbps: float) -> dict:
    """The page's table: one row per side, cells formatted here."""
    cols = ["side", "F", "overlap steps", "utilisation (each run)", "wall s", "compute s",
            "blocked in step() s", "MB sent per worker", f"fragment at {mbps:g} Mbit/s (computed) s",
            "compute between fragment syncs s", "held-out loss"]
    out = []
    for r in rows:
        each = " / ".join(f"{100 * u:.1f}" for u in r["utilisation_each"])
        out.append([r["name"], r["fragments"], r["overlap_steps"], f"{100 * r['utilisation']:.1f} % ({each})",
                     f"{r['wall_seconds']:.1f}", f"{r['compute_seconds']:.1f}", f"{r['blocked_seconds']:.1f}",
                     f"{r['bytes_per_worker'] / 1e6:.1f}", f"{r['fragment_link_seconds_computed']:.2f}",
                     f"{r['compute_between_fragment_syncs_seconds']:.2f}", f"{r['final_loss']:.3f}"])
    return {"columns": cols, "rows": out}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", metavar="CONFIG", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="a small model, 2 sides, few steps (checks the script)")
    p.add_argument("--task", choices=["auto", "gpt", "digits"], default="auto",
                   help="auto: the GPT if the Shakespeare texts are cached, else digits")
    p.add_argument("--mbps", type=float, default=100.0, help="the link's rate each way, Mbit/s (default 100)")
    p.add_argument("--steps", type=int, help="inner steps per run (default 96, quick 24)")
    p.add_argument("--repeats", type=int, help="runs of each side, in alternating order (default 2, quick 1)")
    p.add_argument("--sync-every", type=int, help="H (default 16, quick 8)")
    p.add_argument("--fragments", type=int, help="F of the streaming sides (default 4, quick 2)")
    p.add_argument("--overlap", type=int, help="overlap steps of streaming-overlap (default 3, quick 2)")
    p.add_argument("--out", help="results JSON (default benchmarks/results/diloco_overlap.json; quick: a temporary "
                                 "file)")
    args = p.parse_args(argv)
    if args.worker:
        worker(json.loads(pathlib.Path(args.worker).read_text()))
        return
    reason = netshape.unavailable()
    if reason:
        sys.exit(f"shaped links cannot be built here: {reason}")
    quick_out = pathlib.Path(tempfile.mkdtemp()) / "diloco-overlap-quick.json" if args.quick and not args.out else None
    out = pathlib.Path(args.out) if args.out else (quick_out or RESULTS / "diloco_overlap.json")
    if args.quick and out.resolve().parent == RESULTS.resolve():
        p.error("--quick never writes into benchmarks/results/: pass --out elsewhere")
    ex = load_example()
    try:
        ex.find_text(None)
        text = True
    except SystemExit:
        text = False
    task = args.task if args.task != "auto" else ("gpt" if text else "digits")
    h = args.sync_every or (8 if args.quick else 16)
    fragments = args.fragments or (2 if args.quick else 4)
    overlap = args.overlap if args.overlap is not None else (2 if args.quick else 3)
    repeats = args.repeats or (1 if args.quick else 2)
    cfg = {"task": task, "steps": args.steps or (24 if args.quick else 96), "sync_every": h, "repeats": repeats,
           "batch_size": 8, "seq_len": 64, "dim": 64 if args.quick else 256, "layers": 1 if args.quick else 4,
           "eval_batches": 2 if args.quick else 8, "inner_lr": 3e-3 if task == "gpt" else 1e-2,
           "outer_lr": 0.7, "outer_momentum": 0.9, "compressor": "none", "mbps": args.mbps, "timeout": 120}
    runs = sides(fragments, overlap, args.quick)
    done: dict[str, list[dict]] = {side["name"]: [] for side in runs}
    # every side once, then once more in the reverse order: a drift of the machine's speed weighs on all alike
    order = [side for k in range(repeats) for side in (runs if k % 2 == 0 else runs[::-1])]
    with netshape.Topology(2, up_mbps=args.mbps, down_mbps=args.mbps) as topo, \
            tempfile.TemporaryDirectory() as tmp:
        for i, side in enumerate(order):
            row = run_side(topo, cfg, side, 29500 + i, pathlib.Path(tmp) / str(i))
            done[side["name"]].append(row)
            print(f"{row['name']:18s} F={row['fragments']} tau={row['overlap_steps']:<2d} utilisation "
                  f"{row['utilisation']:6.1%} wall {row['wall_seconds']:6.1f} s "
                  f"compute {row['compute_seconds']:6.1f} s "
                  f"blocked {row['blocked_seconds']:5.1f} s loss {row['final_loss']:.4f}", flush=True)
    rows = [combine(done[side["name"]]) for side in runs]
    given = (("task", args.task if args.task != "auto" else None), ("mbps", args.mbps if args.mbps != 100 else None),
             ("steps", args.steps), ("repeats", args.repeats), ("sync_every", args.sync_every),
             ("fragments", args.fragments),
             ("overlap", args.overlap), ("out", args.out))
    command = "sudo python benchmarks/diloco_overlap.py" + (" --quick" if args.quick else "") + "".join(
        f" --{k.replace('_', '-')} {v:g}" if isinstance(v, float) else f" --{k.replace('_', '-')} {v}"
        for k, v in given if v is not None)
    data = {"benchmark": "diloco_overlap", "command": command, "world_size": 2, "settings": cfg,
            "link": {"mbps_each_way": args.mbps, "shaping": "tbf on both ends of each worker's veth pair "
                     "(benchmarks/netshape.py), gloo over it; no added delay"},
            "machine": {"cpus": os.cpu_count(), "load_average_at_start": done[order[0]["name"]][0]["load_before"],
                        "note": "the CPUs were shared with other jobs: load_before/load_after (1, 5, 15 min) "
                                "per run under runs[*].repeats"},
            "torch": __import__("torch").__version__, "runs": rows, "table": table(rows, args.mbps)}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_suffix(".tmp")
    tmp_out.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp_out, out)
    print()
    print(" | ".join(data["table"]["columns"]))
    for r in data["table"]["rows"]:
        print(" | ".join(str(c) for c in r))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
