"""DiLoCo against DDP: final held-out loss against the bytes each worker sends, 2 gloo workers on loopback.

Every side trains the example's model (``examples/diloco/train.py``: a character-level GPT of 415,744
parameters on the Shakespeare plays fedcomp caches, or its digits CNN with ``--task digits``) for the
same number of inner steps, each worker on its own shard with AdamW, in one run of two spawned
processes (gloo, 127.0.0.1, one thread each):

- ``ddp``: DistributedDataParallel, an fp32 allreduce of the gradients every step;
- ``diloco``: :class:`fedcomp.distributed.DiLoCo` (outer SGD, lr 0.7, Nesterov momentum 0.9, or
  ``--outer-lr``/``--outer-momentum``: lr 1 and momentum 0 average the workers' models) at
  H = 10 and 50 with fp32 (``none``), and at H = 50 with ``int8``, ``sign``, ``stc`` and ``topk``
  (error feedback on for the lossy codecs), and streaming with 5 fragments.

Bytes are what each worker hands to the collectives (``DiLoCo.bytes.sent``; DDP: 4 bytes x
parameters x steps, its gradient allreduce's input). Links are not shaped (loopback): the utilisation
at 100 Mbps is computed, not measured: ``compute / (compute + bytes x 8 / 100e6)``, one compute time
for every side (the fastest side's seconds per inner step), with no overlap of communication and
computation (DiLoCo blocks while it synchronises).

    python benchmarks/diloco.py                  # full: 8-20 minutes on 2 shared cores
    python benchmarks/diloco.py --outer-lr 1 --outer-momentum 0 --out benchmarks/results/diloco_averaging.json
    python benchmarks/diloco.py --quick --out /tmp/diloco.json

``--quick`` (a smaller model, 3 sides, 40 steps) checks the script; its results go to ``--out`` (a
temporary file by default) and never into ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import pathlib
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "diloco" / "train.py"
RESULTS = REPO / "benchmarks" / "results"
MBPS = 100.0


def load_example():
    """The example module (model, data), imported from its file."""
    spec = importlib.util.spec_from_file_location("diloco_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: ``--long``: the target's pair over 3,072 inner steps (6 outer steps of H = 512), models averaged (outer lr 1, no
#: momentum): int8 pseudo-gradients every 512 steps send more than 2,000x fewer bytes than DDP (int8 alone is < 4x).
LONG_SIDES = [{"name": "ddp"},
              {"name": "diloco-int8", "compressor": "int8", "sync_every": 512, "options": {"seed": 0}}]
LONG_STEPS = 3072


def label(side: dict) -> str:
    """``name@H`` (``ddp`` for DDP): a side's name in ``--only``."""
    return side["name"] if side["name"] == "ddp" else f"{side['name']}@{side['sync_every']}"


def sides(quick: bool) -> list[dict]:
    """The configurations compared, DDP first."""
    if quick:
        return [{"name": "ddp"},
                {"name": "diloco-fp32", "compressor": "none", "sync_every": 10},
                {"name": "diloco-stc", "compressor": "stc", "sync_every": 10, "options": {"density": 0.01}}]
    return [{"name": "ddp"},
            {"name": "diloco-fp32", "compressor": "none", "sync_every": 10},
            {"name": "diloco-fp32", "compressor": "none", "sync_every": 50},
            {"name": "diloco-int8", "compressor": "int8", "sync_every": 50, "options": {"seed": 0}},
            {"name": "diloco-sign", "compressor": "sign", "sync_every": 50},
            {"name": "diloco-stc", "compressor": "stc", "sync_every": 50, "options": {"density": 0.01}},
            {"name": "diloco-topk", "compressor": "topk", "sync_every": 50, "options": {"density": 0.01}},
            {"name": "streaming-fp32", "compressor": "none", "sync_every": 50, "fragments": 5},
            {"name": "diloco-fp32", "compressor": "none", "sync_every": 200},
            {"name": "diloco-int8", "compressor": "int8", "sync_every": 200, "options": {"seed": 0}},
            {"name": "diloco-sign", "compressor": "sign", "sync_every": 200},
            {"name": "diloco-stc", "compressor": "stc", "sync_every": 200, "options": {"density": 0.01}}]


def _task(ex, cfg: dict, rank: int, world: int):
    argv = ["--task", cfg["task"], "--batch-size", str(cfg["batch_size"]), "--dim", str(cfg["dim"]),
            "--layers", str(cfg["layers"]), "--seq-len", str(cfg["seq_len"]),
            "--eval-batches", str(cfg["eval_batches"])]
    args = ex.parse_args(argv)
    return args, (ex.TextTask if cfg["task"] == "gpt" else ex.DigitsTask)(args, rank, world)


def _fresh_model(ex, cfg: dict, task) -> torch.nn.Module:
    torch.manual_seed(cfg["seed"])
    if cfg["task"] == "gpt":
        return ex.TinyGPT(len(task.stoi), cfg["seq_len"], dim=cfg["dim"], layers=cfg["layers"])
    return ex.SmallCNN()


def run_side(ex, cfg: dict, side: dict, task, rank: int) -> dict:
    """Train one side for ``cfg["steps"]`` inner steps; its final held-out loss, bytes and times."""
    from fedcomp.distributed import DiLoCo

    task.gen = torch.Generator().manual_seed(1 + rank + 1000 * cfg["seed"])
    model = _fresh_model(ex, cfg, task)
    ddp = side["name"] == "ddp"
    net = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
    inner = torch.optim.AdamW(net.parameters(), lr=cfg["inner_lr"], weight_decay=0.01)
    lr, momentum = side.get("outer", (cfg["outer_lr"], cfg["outer_momentum"]))
    outer = None if ddp else DiLoCo(
        model, inner, compressor=side["compressor"], sync_every=side["sync_every"], fragments=side.get("fragments", 1),
        outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=lr, momentum=momentum, nesterov=momentum > 0),
        **side.get("options", {}))
    params = sum(p.numel() for p in model.parameters())
    curve = []
    dist.barrier()
    began = time.perf_counter()
    for step in range(1, cfg["steps"] + 1):
        x, y = task.batch()
        task.loss(net(x), y).backward()
        inner.step()
        inner.zero_grad(set_to_none=True)
        if outer is not None:
            outer.step()
        if step % cfg["eval_every"] == 0 or step == cfg["steps"]:  # the final loss: after the last step
            pause = time.perf_counter()
            curve.append([step, ex.evaluate(model, task, torch.device("cpu"))])
            began += time.perf_counter() - pause  # evaluation is not training time
    wall = time.perf_counter() - began
    sent = 4 * params * cfg["steps"] if ddp else outer.bytes.sent
    sync = 0.0 if ddp else outer.sync_seconds
    return {"name": side["name"], "seed": cfg["seed"], "compressor": side.get("compressor", "none"),
            "options": side.get("options", {}),
            "sync_every": side.get("sync_every", 1), "fragments": side.get("fragments", 1),
            "error_feedback": False if ddp else outer.error_feedback, "parameters": params,
            "outer_lr": None if ddp else lr, "outer_momentum": None if ddp else momentum,
            "final_loss": curve[-1][1], "curve": curve, "bytes_per_worker": sent,
            "dense_bytes_per_worker": 4 * params * cfg["steps"], "wall_seconds": wall, "sync_seconds": sync}


def worker(rank: int, world: int, port: int, cfg: dict, results) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
        ex = load_example()
        _, task = _task(ex, cfg, rank, world)
        rows = []
        for side in cfg["sides"]:
            rows.append(run_side(ex, cfg, side, task, rank))
            if rank == 0:
                r = rows[-1]
                print(f"{r['name']:15s} H={r['sync_every']:<4d} F={r['fragments']} loss {r['final_loss']:.4f} "
                      f"{r['bytes_per_worker'] / 1e6:9.3f} MB/worker {r['wall_seconds']:6.1f} s", flush=True)
        results.put((rank, rows))
        dist.destroy_process_group()
    except BaseException as exc:
        results.put((rank, f"{type(exc).__name__}: {exc}"))
        raise


def text_available(ex) -> bool:
    try:
        ex.find_text(None)
    except SystemExit:
        return False
    return True


def summarise(rows: list[dict], steps: int) -> list[dict]:
    """Ratios against DDP (the first row), the loss gap in %, and the utilisation at 100 Mbps, computed:
    ``compute / (compute + bytes x 8 / 100e6)`` with ``compute = steps x`` the fastest side's seconds per
    inner step outside synchronisation (on a shared machine the slower sides were slowed by others)."""
    ddp = rows[0]
    per_step = min((r["wall_seconds"] - r["sync_seconds"]) / steps for r in rows)
    for r in rows:
        compute = steps * per_step
        link = r["bytes_per_worker"] * 8 / (MBPS * 1e6)
        r["ratio_vs_ddp"] = ddp["bytes_per_worker"] / r["bytes_per_worker"]
        r["loss_gap_pct"] = 100.0 * (r["final_loss"] - ddp["final_loss"]) / ddp["final_loss"]
        r["utilisation_100mbps_computed"] = compute / (compute + link)
        r["target_met"] = bool(r["ratio_vs_ddp"] >= 2000 and r["loss_gap_pct"] <= 2.0)
    return rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_seed(cfg: dict) -> list[dict]:
    """Every side of ``cfg`` for its seed, in one group of 2 gloo workers; rank 0's rows."""
    world, port = 2, free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, cfg, results)) for r in range(world)]
    for proc in procs:
        proc.start()
    got = dict(results.get(timeout=3 * 3600) for _ in range(world))
    for proc in procs:
        proc.join(timeout=60)
    failed = {r: v for r, v in got.items() if isinstance(v, str)}
    if failed or any(proc.exitcode for proc in procs):
        sys.exit(f"a worker failed: {failed or [proc.exitcode for proc in procs]}")
    return got[0]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smaller model, 3 sides, 40 steps (checks the script)")
    p.add_argument("--task", choices=["auto", "gpt", "digits"], default="auto",
                   help="auto: the GPT if the Shakespeare texts are cached, else digits")
    p.add_argument("--steps", type=int, help="inner steps per side (default 600, quick 40)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="outer SGD's lr (default 0.7, DiLoCo's)")
    p.add_argument("--outer-momentum", type=float, default=0.9,
                   help="outer SGD's Nesterov momentum (default 0.9, DiLoCo's; 0: plain SGD)")
    p.add_argument("--long", action="store_true",
                   help=f"the target's pair ({', '.join(label(s) for s in LONG_SIDES)}) over {LONG_STEPS} inner steps; "
                        "default output benchmarks/results/diloco_long.json")
    p.add_argument("--seeds", type=int, nargs="+", default=[0],
                   help="model initialisation and data order (seed 0: the committed runs'); each seed its own group")
    p.add_argument("--only", nargs="+", default=[], help="run only these sides (name@H, or ddp, which is always run)")
    p.add_argument("--out", help="results JSON (default benchmarks/results/diloco.json; quick: a temporary file)")
    args = p.parse_args(argv)
    ex = load_example()
    task = args.task if args.task != "auto" else ("gpt" if text_available(ex) else "digits")
    if args.task == "auto" and task == "digits":
        print("the Shakespeare texts are not cached: benchmarking the digits CNN instead", flush=True)
    out = pathlib.Path(args.out) if args.out else (
        pathlib.Path(tempfile.mkdtemp()) / "diloco-quick.json" if args.quick else
        RESULTS / ("diloco_long.json" if args.long else "diloco.json"))
    if args.quick and out.resolve().parent == RESULTS.resolve():
        p.error("--quick never writes into benchmarks/results/: pass --out elsewhere")
    steps = args.steps or (40 if args.quick else LONG_STEPS if args.long else 600)
    chosen = LONG_SIDES if args.long else sides(args.quick)
    if args.only:
        unknown = set(args.only) - {label(s) for s in chosen}
        if unknown:
            p.error(f"--only: no side {sorted(unknown)} (sides: {[label(s) for s in chosen]})")
        chosen = [s for s in chosen if label(s) == "ddp" or label(s) in args.only]
    cfg = {"task": task, "steps": steps, "eval_every": 10 if args.quick else 64 if args.long else 50,
           "batch_size": 16, "seq_len": 64, "dim": 32 if args.quick else 128, "layers": 1 if args.quick else 2,
           "eval_batches": 2 if args.quick else 16, "inner_lr": 3e-3 if task == "gpt" else 1e-2,
           "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum, "sides": chosen}
    rows = [r for seed in args.seeds for r in summarise(run_seed({**cfg, "seed": seed}), steps)]
    settings = {k: v for k, v in cfg.items() if k != "sides"} | {"seeds": args.seeds}
    command = "python benchmarks/diloco.py" + (" --quick" if args.quick else "") + (" --long" if args.long else "") + \
        (f" --seeds {' '.join(map(str, args.seeds))}" if args.seeds != [0] else "") + \
        (f" --only {' '.join(args.only)}" if args.only else "") + \
        (f" --task {args.task}" if args.task != "auto" else "") + (f" --steps {args.steps}" if args.steps else "") + \
        (f" --outer-lr {args.outer_lr:g} --outer-momentum {args.outer_momentum:g}"
         if (args.outer_lr, args.outer_momentum) != (0.7, 0.9) else "") + (f" --out {args.out}" if args.out else "")
    data = {"benchmark": "diloco", "command": command, "world_size": 2, "settings": settings,
            "link": "loopback (not shaped); utilisation at 100 Mbps computed without overlap",
            "torch": torch.__version__, "runs": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, out)
    print(f"\n{'side':15s} {'seed':>4s} {'H':>4s} {'F':>2s} {'loss':>7s} {'gap %':>6s} {'MB/worker':>10s} "
          f"{'x fewer':>9s} {'util@100M':>9s}")
    for r in rows:
        print(f"{r['name']:15s} {r['seed']:4d} {r['sync_every']:4d} {r['fragments']:2d} {r['final_loss']:7.4f} "
              f"{r['loss_gap_pct']:6.2f} "
              f"{r['bytes_per_worker'] / 1e6:10.3f} {r['ratio_vs_ddp']:9.0f} {r['utilisation_100mbps_computed']:9.1%}")
    print(f"results: {out}")


if __name__ == "__main__":
    main()
