"""DDP communication hooks over shaped links: DDP's own fp32 allreduce, torch's bf16 and PowerSGD hooks and
fedcomp's codecs through ``fedcomp.distributed.compression_hook``, on a BatchNorm ResNet and a small GPT.

Run: ``sudo python benchmarks/ddp_links.py [--mbps MBPS ...] [--models resnet gpt] [--steps N] [--quick]``

``benchmarks/ddp_hook.py`` counts the bytes on loopback, where a collective's time is latency and copies;
here the two gloo ranks talk over a link of ``--mbps`` Mbit/s each way (``benchmarks/netshape.py``'s
``Topology``: each rank in its own network namespace, a ``tbf`` qdisc on both ends of its veth pair,
``GLOO_SOCKET_IFNAME`` its veth), so the time a side saves by sending fewer bytes shows in its steps and in
its time to a quality. One process per rank, one thread each; the sides of every model run one after the
other in the same two processes, from the same initial model and the same batches:

- ``resnet``: a BatchNorm ResNet (three stages of two basic blocks, 32/64/128 channels) on scikit-learn's
  digits (8x8, as they are), each rank its own shard, batch 32 per rank, SGD lr 0.05 with momentum 0.9 (the
  hook benchmark's settings); test accuracy on the 360 held-out images;
- ``gpt``: the DiLoCo example's character-level GPT (``examples/diloco/train.py``) at width 192 with 4
  blocks, on the Shakespeare plays the project caches, each rank its slice of the training text, batch 8
  windows of 64 characters per rank, AdamW lr 2e-3; loss on 12 fixed held-out batches.

Per side, as in ``benchmarks/ddp_hook.py`` (whose ``train_side`` runs every side): the bytes this rank
handed to the collectives (wrapping ``dist.all_reduce``/``all_gather``; DDP without a hook: its fp32
buckets), the step's time split into compute (the step minus the hook), encode+decode (the hook minus its
collectives) and communication (the collectives), the held-out quality every few steps against the steps
and against the training time (evaluations left out of the clock). DDP without a hook allreduces in C++,
overlapped with the backward pass and past the wrapper: its compute is timed alone, on a copy of the model
without DDP, before and after the side (every side gets the same measurement, a gauge of the machine's
load), and its communication is the rest of its step. Every hook is timed up to its future's completion,
so a torch hook's asynchronous collectives are waited for inside it (fedcomp's hook is synchronous anyway).
Also the bytes each rank's interface sent (``/sys/class/net``: headers and DDP's buffer broadcast
included) and the machine's load average before and after each side.

By default both models run at 100 Mbit/s and the ResNet also at 1 Gbit/s, the GPT without int8 and QSGD
(``PLAN``, ``MODEL_SIDES``: what fits 30-45 minutes on 2 shared cores), one seed;
``--mbps`` and ``--models`` run every model given at every rate given.

DDP runs ``steps`` steps and its final quality (accuracy for the ResNet, loss for the GPT) is the target:
every other side runs at least as many steps and goes on (at most ``extend`` times as many) until it reaches
that quality or has trained as long as DDP did (`stopper`), so that a side that is faster per step but
needs more steps is timed to the target too. Then, per link and model (`compare`): the training time and
steps each side takes to first reach it, at the evaluations; the same time at a common compute (computed:
the machine's other jobs change the compute from side to side); its quality at DDP's number of steps; and
the targets, each with whether it is met.

Needs root, ``ip`` and ``tc`` (``netshape.unavailable()`` says what is missing). Prints a table per link
and model and writes ``benchmarks/results/ddp_links.json``; ``--quick`` runs small models, few steps and
three sides at 100 Mbit/s into the temporary folder, never into ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import ddp_hook  # benchmarks/ is not a package
import netshape
from diloco_overlap import load_example
from outputs import RESULTS, output_path, shown

#: the sides compared (name, kind, options): ``benchmarks/ddp_hook.py``'s, less torch's fp16 hook (bf16 runs here)
SIDES = [side for side in ddp_hook.SIDES if side[1] != "torch-fp16"]
KINDS = {name: kind for name, kind, _ in SIDES}
#: the sides each model runs: the GPT leaves out int8 and QSGD (they send the most of the codecs, to fit the time)
MODEL_SIDES = {"resnet": [s[0] for s in SIDES],
               "gpt": [s[0] for s in SIDES if s[0] not in ("fedcomp int8", "fedcomp qsgd")]}
#: the default runs: (Mbit/s, models); the second link only for the ResNet, to fit the benchmark's time
PLAN = [(100.0, ["resnet", "gpt"]), (1000.0, ["resnet"])]
#: the sides of --quick: DDP, torch's PowerSGD, one fedcomp codec
QUICK_SIDES = ["ddp (fp32 allreduce)", "torch PowerSGD r1", "fedcomp stc 0.01"]

#: per model: DDP's steps (every other side runs at least as many, at most ``extend`` times as many: see
#: `stopper`), evaluation every so many steps, the model's size, steps timed alone around each side
SETTINGS = {
    "resnet": {"steps": 300, "extend": 4, "eval_every": 10, "widths": [32, 64, 128], "blocks": 2,
               "batch_size": 32, "alone_steps": 8},
    "gpt": {"steps": 300, "extend": 4, "eval_every": 25, "dim": 192, "layers": 4, "seq_len": 64, "batch_size": 8,
            "eval_batches": 12, "lr": 2e-3, "alone_steps": 5},
}
QUICK_SETTINGS = {
    "resnet": {**SETTINGS["resnet"], "steps": 12, "extend": 2, "eval_every": 6, "widths": [8, 16, 32], "blocks": 1,
               "alone_steps": 2},
    "gpt": {**SETTINGS["gpt"], "steps": 12, "extend": 2, "eval_every": 6, "dim": 32, "layers": 1, "eval_batches": 2,
            "alone_steps": 2},
}
#: steps left out of the per-step times (warm-ups: fedcomp's one fp32 step, torch PowerSGD's two)
SKIP = 5


# -- the tasks (what ddp_hook.train_side trains) ---------------------------------------------------------

def resnet(widths: list[int], blocks: int):
    """A BatchNorm ResNet for 1x8x8 digits: a 3x3 stem, ``len(widths)`` stages of ``blocks`` basic blocks
    (fedcomp's ``BasicBlock``; every stage after the first halves the resolution), global average pooling
    and a linear layer to 10 classes."""
    import torch
    from torch import nn

    from fedcomp.task.models import BasicBlock

    class DigitsResNetWide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(1, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]),
                                      nn.ReLU())
            layers, cin = [], widths[0]
            for stage, width in enumerate(widths):
                for b in range(blocks):
                    layers.append(BasicBlock(cin, width, stride=2 if stage and not b else 1))
                    cin = width
            self.layers = nn.Sequential(*layers)
            self.fc = nn.Linear(cin, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.layers(self.stem(x)).mean(dim=(2, 3)))

    return DigitsResNetWide()


class ResNetTask(ddp_hook.DigitsTask):
    """The hook benchmark's digits task (shards, SGD, batch, test split) with the ResNet of ``settings``."""

    def __init__(self, settings: dict, seed: int, rank: int, world: int) -> None:
        super().__init__(seed, rank, world)
        self.settings = settings
        self.batch_size = settings["batch_size"]

    def model(self):
        return resnet(self.settings["widths"], self.settings["blocks"])


class TextTask:
    """The DiLoCo example's next-character task and GPT (``TextTask``, ``TinyGPT``, ``evaluate``) with
    AdamW; the loss on the example's fixed held-out batches (no accuracy)."""

    def __init__(self, settings: dict, seed: int, rank: int, world: int) -> None:
        self.ex, self.settings = load_example(), settings
        args = self.ex.parse_args(["--batch-size", str(settings["batch_size"]), "--dim", str(settings["dim"]),
                                   "--layers", str(settings["layers"]), "--seq-len", str(settings["seq_len"]),
                                   "--eval-batches", str(settings["eval_batches"]), "--seed", str(seed)])
        self.inner = self.ex.TextTask(args, rank, world)
        self.loss = self.ex.TextTask.loss

    def model(self):
        s = self.settings
        return self.ex.TinyGPT(len(self.inner.stoi), s["seq_len"], dim=s["dim"], layers=s["layers"])

    def optimizer(self, params):
        import torch

        return torch.optim.AdamW(params, lr=self.settings["lr"], weight_decay=0.01)

    def batch(self, gen):
        self.inner.gen = gen
        return self.inner.batch()

    def evaluate(self, module) -> dict:
        import torch

        return {"loss": self.ex.evaluate(module, self.inner, torch.device("cpu")), "accuracy": None}


TASKS = {"resnet": ResNetTask, "gpt": TextTask}
#: the quality each model is held to: DDP's final test accuracy (ResNet), its final held-out loss (GPT)
METRIC = {"resnet": "accuracy", "gpt": "loss"}


# -- one rank (runs inside its namespace) --------------------------------------------------------------

def compute_alone_ms(task, steps: int, seed: int) -> float:
    """Milliseconds per training step (forward, backward, optimizer) of a fresh copy of the task's model
    without DDP, on batches of its own: the compute a step needs on this machine now."""
    import torch

    torch.manual_seed(seed)
    model = task.model()
    opt = task.optimizer(model.parameters())
    gen = torch.Generator().manual_seed(seed + 7919)
    times = []
    for _ in range(steps + 1):  # the first step warms up (allocations)
        x, y = task.batch(gen)
        t0 = time.perf_counter()
        opt.zero_grad()
        task.loss(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.fmean(times[1:])


def link_counters(ifname: str) -> dict:
    """Bytes this namespace's veth end has sent and received so far, and the machine's load average."""
    stats = pathlib.Path("/sys/class/net") / ifname / "statistics"
    return {"tx_bytes": int((stats / "tx_bytes").read_text()), "rx_bytes": int((stats / "rx_bytes").read_text()),
            "load": list(os.getloadavg())}


def reached(point: dict, target: float, metric: str) -> bool:
    """Whether a point of a curve is at DDP's final quality: accuracy at least, or loss at most, ``target``."""
    value = point[metric]
    return value >= target - 1e-9 if metric == "accuracy" else value <= target + 1e-9


def stopper(target: dict, steps: int):
    """When a side that may run past ``steps`` ends: at the first evaluation from ``steps`` on where it has
    reached DDP's final quality or trained as long as DDP did (``target``: DDP's ``metric``, ``value`` and
    ``train_s``). Rank 0 decides on its clock and every rank follows (a one-byte broadcast per evaluation,
    outside the steps)."""
    import torch
    import torch.distributed as dist

    def stop(point: dict) -> bool:
        done = point["step"] >= steps and (reached(point, target["value"], target["metric"])
                                           or point["train_s"] >= target["train_s"])
        flag = torch.tensor([int(done)], dtype=torch.uint8)
        dist.broadcast(flag, 0)
        return bool(flag.item())

    return stop


def worker(cfg: dict) -> None:
    """Train every side of every model as rank ``cfg["rank"]``; write the results to ``cfg["out"]`` (JSON,
    rewritten after each side)."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = cfg["rank"], cfg["world_size"]
    meter = ddp_hook.Meter()
    ddp_hook.wrap_collectives(meter)
    dist.init_process_group("gloo", init_method=f"tcp://{cfg['master']}:{cfg['port']}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=cfg["timeout"]))
    results = []
    for model in cfg["models"]:
        settings = cfg["settings"][model]
        task = TASKS[model](settings, cfg["seed"], rank, world)
        target = None  # DDP's final quality and training time, once its side has run
        for side in (s for s in cfg["sides"] if s[0] in cfg["model_sides"][model]):
            longer = side[1] != "ddp" and target is not None
            train_cfg = {"steps": settings["steps"] * (settings["extend"] if longer else 1),
                         "eval_every": settings["eval_every"], "seed": cfg["seed"]}
            alone = [compute_alone_ms(task, settings["alone_steps"], cfg["seed"])]
            res = ddp_hook.train_side(rank, world, tuple(side), task, train_cfg, meter,
                                      probe=lambda: link_counters(cfg["ifname"]),
                                      on_eval=(lambda point, m=model, s=side[0]: print(m, s, point, flush=True))
                                      if rank == 0 else None,
                                      stop=stopper(target, settings["steps"]) if longer else None)
            alone.append(compute_alone_ms(task, settings["alone_steps"], cfg["seed"]))
            results.append({"model": model, "side": side[0], "compute_alone_ms": alone, **res})
            if side[1] == "ddp" and "error" not in res:
                target = {"metric": METRIC[model], "value": res["curve"][-1][METRIC[model]],
                          "train_s": res["curve"][-1]["train_s"]}
            tmp = pathlib.Path(cfg["out"]).with_suffix(".tmp")
            tmp.write_text(json.dumps(results))
            os.replace(tmp, cfg["out"])
            if rank == 0:
                print(f"{model} {side[0]}: {res.get('error') or res['curve'][-1]}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


# -- the parent (root namespace) -----------------------------------------------------------------------

def summarize(per_rank: list[dict], model: str, mbps: float, settings: dict) -> dict:
    """One side's row: ``ddp_hook.summarize``'s figures (rank 0's times and curve) with this benchmark's own:
    DDP's compute timed alone, the bytes on the wire per step, the load."""
    r0 = per_rank[0]
    row = {"model": model, "mbps": mbps, "side": r0["side"]}
    if any("error" in r for r in per_rank):
        return {**row, "error": next(r["error"] for r in per_rank if "error" in r)}
    row.update(ddp_hook.summarize(per_rank, {"skip": SKIP}))
    steps, curve = settings["steps"], r0["curve"]
    first = r0["bytes"][:steps]  # the bytes of DDP's steps: one warm-up step weighs alike on every side
    row["bytes_per_step"] = statistics.fmean(first)
    row["ratio"] = 4 * row["numel"] * len(first) / sum(first)
    at = [p for p in curve if p["step"] <= steps][-1]  # the quality at DDP's steps
    row.update(final_loss=at["loss"], final_accuracy=at["accuracy"], train_s=at["train_s"],
               steps_run=curve[-1]["step"], last_loss=curve[-1]["loss"], last_accuracy=curve[-1]["accuracy"],
               train_s_all=curve[-1]["train_s"])
    row["compute_alone_ms"] = statistics.fmean(r0["compute_alone_ms"])
    if KINDS[r0["side"]] == "ddp":  # no hook: DDP's allreduce is the rest of the step
        row["compute_ms"] = row["compute_alone_ms"]
        row["comm_ms"] = max(0.0, row["step_ms"] - row["compute_ms"])
        row["encode_decode_share"] = None
    else:
        row["encode_decode_share"] = row["encode_decode_ms"] / row["compute_ms"]
    row["wire_bytes_per_step"] = statistics.fmean(
        (r["probe"]["after"]["tx_bytes"] - r["probe"]["before"]["tx_bytes"]) / len(r["bytes"]) for r in per_rank)
    row["load"] = [r0["probe"]["before"]["load"][0], r0["probe"]["after"]["load"][0]]
    return row


def reach(curve: list[dict], target: float, metric: str) -> dict | None:
    """The first point of ``curve`` at DDP's final quality (see `reached`), or None."""
    return next((point for point in curve if reached(point, target, metric)), None)


def compare(rows: list[dict]) -> list[dict]:
    """Per link and model: each side's steps and training time to DDP's final quality, its speed-up over
    DDP and over the faster of torch's PowerSGD ranks, its quality against DDP's at the same steps; and
    the targets (``kind``: ``"time"``, ``"share"``, ``"quality"``), each with ``met``."""
    targets = []
    for seed, mbps, model in dict.fromkeys((r.get("seed", 0), r["mbps"], r["model"]) for r in rows):
        group = [r for r in rows if (r.get("seed", 0), r["mbps"], r["model"]) == (seed, mbps, model)
                 and "error" not in r]
        ddp = next((r for r in group if KINDS[r["side"]] == "ddp"), None)
        if ddp is None:
            continue
        metric = METRIC[model]
        target = ddp["curve"][-1][metric]
        # the machine's other jobs change the compute from side to side: a step at the group's median compute
        # (timed alone), the side's encode+decode scaled alike, its communication as measured (computed)
        common = statistics.median(r["compute_alone_ms"] for r in group)
        for r in group:
            point = reach(r["curve"], target, metric)
            r["target_metric"], r["target"] = metric, target
            r["steps_to_ddp_final"] = point["step"] if point else None
            r["time_to_ddp_final_s"] = point["train_s"] if point else None
            r["step_ms_at_common_compute"] = common + r["encode_decode_ms"] * common / r["compute_ms"] + r["comm_ms"]
            r["time_to_ddp_final_at_common_compute_s"] = (point["step"] * r["step_ms_at_common_compute"] / 1000
                                                          if point else None)
            r["quality_gap"] = (ddp["final_accuracy"] - r["final_accuracy"] if metric == "accuracy"
                                else (r["final_loss"] - ddp["final_loss"]) / ddp["final_loss"])
        psgd = [r for r in group if KINDS[r["side"]] == "torch-powersgd" and r["time_to_ddp_final_s"] is not None]
        best = min(psgd, key=lambda r: r["time_to_ddp_final_s"]) if psgd else None
        best_common = min((r["time_to_ddp_final_at_common_compute_s"] for r in psgd), default=None)
        for r in group:
            mine, mine_common = r["time_to_ddp_final_s"], r["time_to_ddp_final_at_common_compute_s"]
            r["speedup_vs_ddp"] = ddp["time_to_ddp_final_s"] / mine if mine else None
            r["speedup_vs_powersgd"] = best["time_to_ddp_final_s"] / mine if mine and best else None
            r["speedup_vs_powersgd_at_common_compute"] = (best_common / mine_common if mine_common and best_common
                                                           else None)
        fed = [r for r in group if KINDS[r["side"]] == "fedcomp" and r["time_to_ddp_final_s"] is not None]
        fastest = min(fed, key=lambda r: r["time_to_ddp_final_s"]) if fed else None
        speedup = fastest["speedup_vs_powersgd"] if fastest else None
        # PowerSGD not at DDP's final quality when its runs ended: they bound its time from below
        bound = (min(r["train_s_all"] for r in group if KINDS[r["side"]] == "torch-powersgd") /
                 fastest["time_to_ddp_final_s"] if fastest and not best else None)
        # the most any side could gain over PowerSGD at PowerSGD's steps: one that sends nothing and takes no
        # time to encode, its step the compute alone
        ceiling = (best["step_ms_at_common_compute"] / common if best else None)
        targets.append({
            "seed": seed, "mbps": mbps, "model": model, "kind": "time", "side": fastest["side"] if fastest else None,
            "ceiling_at_powersgd_steps": ceiling,
            "time_s": fastest["time_to_ddp_final_s"] if fastest else None,
            "powersgd_side": best["side"] if best else None,
            "powersgd_time_s": best["time_to_ddp_final_s"] if best else None, "speedup": speedup,
            "speedup_at_least": bound,
            "speedup_at_common_compute": fastest["speedup_vs_powersgd_at_common_compute"] if fastest else None,
            "met": time_verdict(fastest, speedup, bound)})
        for r in group:
            if r["side"] in ("fedcomp sign", "fedcomp stc 0.01", "fedcomp topk 0.01"):
                targets.append({"seed": seed, "mbps": mbps, "model": model, "kind": "share", "side": r["side"],
                                "share": r["encode_decode_share"],
                                "met": "met" if r["encode_decode_share"] < 0.25 else "not met"})
            if KINDS[r["side"]] == "fedcomp" and r["ratio"] >= 100:
                limit = 0.01 if metric == "accuracy" else 0.02
                targets.append({"seed": seed, "mbps": mbps, "model": model, "kind": "quality", "side": r["side"],
                                "ratio": r["ratio"], "gap": r["quality_gap"], "limit": limit,
                                "met": "met" if r["quality_gap"] <= limit else "not met"})
    return targets + over_seeds(targets)


def over_seeds(targets: list[dict]) -> list[dict]:
    """Per link and model run with several seeds: the time target's figures per seed and their medians
    (``kind`` ``"time over seeds"``); ``met`` where the median speed-ups, measured and at a common compute, are
    both at least 1.5."""
    out = []
    times = [t for t in targets if t["kind"] == "time"]
    for mbps, model in dict.fromkeys((t["mbps"], t["model"]) for t in times):
        per_seed = [t for t in times if (t["mbps"], t["model"]) == (mbps, model)]
        if len(per_seed) < 2:
            continue
        row = {"mbps": mbps, "model": model, "kind": "time over seeds", "seeds": [t["seed"] for t in per_seed]}
        for key in ("speedup", "speedup_at_common_compute", "ceiling_at_powersgd_steps"):
            values = [t[key] for t in per_seed]
            row[key] = values
            row[f"median_{key}"] = statistics.median(values) if None not in values else None
        row["sides"] = [t["side"] for t in per_seed]
        measured, common = row["median_speedup"], row["median_speedup_at_common_compute"]
        row["met"] = "not measurable" if measured is None or common is None else agreed_verdict(measured, common)
        out.append(row)
    return out


def time_verdict(fastest: dict | None, speedup: float | None, bound: float | None) -> str:
    """Whether the fastest fedcomp side reached DDP's final quality 1.5 times sooner than torch's PowerSGD:
    "met" only where both the measured times and the times at a common compute say so (the machine's
    other jobs can make one side's steps slower than another's)."""
    if fastest is None:
        return "not measurable: no fedcomp side reached DDP's final quality"
    if speedup is None:
        return ("met" if bound >= 1.5 else "not measurable") + ": neither PowerSGD rank reached it"
    return agreed_verdict(speedup, fastest["speedup_vs_powersgd_at_common_compute"])


def agreed_verdict(speedup: float, common: float) -> str:
    """"met" where the speed-up is at least 1.5 both as measured and at a common compute, else which one falls
    short."""
    if (speedup >= 1.5) == (common >= 1.5):
        return "met" if speedup >= 1.5 else "not met"
    return ("not met: " if common < 1.5 else "met at a common compute, ") + (
        "met as measured, not at a common compute" if speedup >= 1.5 else "not as measured")


def run_link(mbps: float, cfg: dict, models: list[str], sides: list, timeout: float) -> list[dict]:
    """Every side of every model over one shaped link (both ranks, one process each): one row per side."""
    with netshape.Topology(2, up_mbps=mbps, down_mbps=mbps) as topo, tempfile.TemporaryDirectory() as tmp:
        argvs, outs, logs = [], [], []
        for rank in range(2):
            out, log, spec_file = (pathlib.Path(tmp) / f"rank{rank}.{ext}" for ext in ("json", "log", "config"))
            spec_file.write_text(json.dumps({**cfg, "rank": rank, "world_size": 2, "master": topo.client_ips[0],
                                             "port": 29500, "ifname": topo.client_ifname(rank), "models": models,
                                             "sides": sides, "model_sides": MODEL_SIDES, "out": str(out)}))
            argvs.append([sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", str(spec_file)])
            outs.append(out)
            logs.append(log)
        print(f"{mbps:g} Mbit/s: {', '.join(models)}; rank 0's log: {logs[0]}", flush=True)
        codes = topo.run_ranks(argvs, logs, timeout)
        if any(codes) or not all(o.is_file() for o in outs):
            sys.exit(f"the run at {mbps:g} Mbit/s failed:\n{topo.log_tails(codes, logs)}")
        per_rank = [json.loads(o.read_text()) for o in outs]
    return [summarize([r[i] for r in per_rank], per_rank[0][i]["model"], mbps, cfg["settings"][per_rank[0][i]["model"]])
            for i in range(len(per_rank[0]))]


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['side']:22s} not run: {r['error']}"
    quality = (f"acc {100 * r['final_accuracy']:5.1f} %" if r["final_accuracy"] is not None
               else f"loss {r['final_loss']:.3f}")
    reached = (f"{r['time_to_ddp_final_s']:6.1f} s ({r['steps_to_ddp_final']} steps)"
               if r.get("time_to_ddp_final_s") is not None else "not reached")
    share = f"{100 * r['encode_decode_share']:4.0f} %" if r["encode_decode_share"] is not None else "   -  "
    return (f"{r['side']:22s} {r['bytes_per_step'] / 1e3:9.1f} kB/step {r['ratio']:6.1f}x  step {r['step_ms']:6.1f} ms "
            f"= compute {r['compute_ms']:5.1f} + enc/dec {r['encode_decode_ms']:5.1f} + comm {r['comm_ms']:6.1f}  "
            f"enc/dec {share}  {quality}  to DDP's final: {reached}  train {r['train_s']:6.1f} s  "
            f"identical {r['replicas_identical']}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", metavar="CONFIG", help=argparse.SUPPRESS)
    p.add_argument("--mbps", type=float, nargs="+", help="link rates, Mbit/s each way, every model at each (default: "
                   "both models at 100, the ResNet at 1000; quick 100)")
    p.add_argument("--models", nargs="+", choices=sorted(TASKS), help="default: both (gpt only if the text is cached)")
    p.add_argument("--steps", type=int, help="steps per side, every model (default 300; quick 12)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="model initialisation and data order, one run "
                   "of the whole plan each (default 0; every seed's rows in one file, with the time target's medians)")
    p.add_argument("--quick", action="store_true", help="small models, 12 steps, 3 sides, 100 Mbit/s; temporary folder")
    p.add_argument("--compare", metavar="FILE", help="recompute the comparisons and targets of a result file "
                   "from its measurements (no run)")
    p.add_argument("--out", help="results JSON (default benchmarks/results/ddp_links.json; quick: a temporary file)")
    args = p.parse_args(argv)
    if args.worker:
        worker(json.loads(pathlib.Path(args.worker).read_text()))
        return
    if args.compare:
        path = pathlib.Path(args.compare)
        data = json.loads(path.read_text())
        data["targets"] = compare(data["runs"])
        path.write_text(json.dumps(data, indent=1) + "\n")
        print(f"compared again: {shown(path)}")
        return
    if (reason := netshape.unavailable()) is not None:
        sys.exit(f"shaped links cannot be built here: {reason}")
    out = output_path("ddp_links", args.out, args.quick)
    if args.quick and out.resolve().parent == RESULTS.resolve():
        p.error("--quick never writes into benchmarks/results/: pass --out elsewhere")
    try:
        load_example().find_text(None)
        text = True
    except SystemExit:
        text = False
    models = args.models or (["resnet", "gpt"] if text else ["resnet"])
    if args.quick:
        plan = [(m, models) for m in (args.mbps or [100.0])]
    elif args.mbps or args.models:
        plan = [(m, models) for m in (args.mbps or [r for r, _ in PLAN])]
    else:
        plan = [(m, [x for x in ms if x in models]) for m, ms in PLAN]
    settings = {m: dict((QUICK_SETTINGS if args.quick else SETTINGS)[m]) for m in models}
    for s in settings.values():
        s["steps"] = args.steps or s["steps"]
        s["eval_every"] = min(s["eval_every"], s["steps"])
    sides = [s for s in SIDES if not args.quick or s[0] in QUICK_SIDES]
    began, load = time.monotonic(), list(os.getloadavg())
    rows = []
    for seed in args.seeds:
        cfg = {"settings": settings, "seed": seed, "timeout": 300}
        for mbps, run_models in plan:
            rows += [{**row, "seed": seed}
                     for row in run_link(mbps, cfg, run_models, sides, timeout=120 if args.quick else 5400)]
    targets = compare(rows)
    for seed, mbps, model in dict.fromkeys((r["seed"], r["mbps"], r["model"]) for r in rows):
        print(f"\n{model} at {mbps:g} Mbit/s, seed {seed}")
        for r in rows:
            if (r["seed"], r["mbps"], r["model"]) == (seed, mbps, model):
                print(_line(r))
    print()
    for t in targets:
        seed = f", seed {t['seed']}" if "seed" in t else ""
        print(f"{t['model']} {t['mbps']:g} Mbit/s{seed}: target {t['kind']}: {t.get('side') or t.get('sides')}: "
              f"{t['met']}")
    given = (("mbps", " ".join(f"{m:g}" for m in args.mbps) if args.mbps else None),
             ("models", " ".join(args.models) if args.models else None), ("steps", args.steps),
             ("seeds", " ".join(map(str, args.seeds)) if args.seeds != [0] else None))
    command = "sudo python benchmarks/ddp_links.py" + (" --quick" if args.quick else "") + "".join(
        f" --{k} {v}" for k, v in given if v is not None)
    data = {"benchmark": "ddp_links", "command": command, "world_size": 2, "backend": "gloo", "seeds": args.seeds,
            "seeds_note": ("one seed: three of the whole plan did not fit the benchmark's time" if len(args.seeds) == 1
                           else "every seed runs the whole plan; targets[kind=time over seeds] holds the medians"),
            "settings": settings,
            "timing_skips_first_steps": SKIP, "torch_threads_per_rank": 1,
            "model_sides": {m: MODEL_SIDES[m] for m in models},
            "link": {"mbps_each_way": [m for m, _ in plan], "models": {f"{m:g}": ms for m, ms in plan},
                     "shaping": "tbf on both ends of each rank's veth pair "
                     "(benchmarks/netshape.py), gloo over it; no added delay"},
            "machine": {"cpus": os.cpu_count(), "load_average_at_start": load,
                        "minutes": (time.monotonic() - began) / 60,
                        "note": "the CPUs were shared with other jobs: runs[*].load is the 1-minute load average "
                                "before and after each side, runs[*].compute_alone_ms the step's compute timed "
                                "alone around it"},
            "torch": __import__("torch").__version__, "runs": rows, "targets": targets}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_suffix(".tmp")
    tmp_out.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp_out, out)
    print(f"wrote {shown(out)}")


if __name__ == "__main__":
    main()
