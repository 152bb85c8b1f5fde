"""DDP communication hooks compared: DDP's own fp32 allreduce, torch's fp16/bf16 and PowerSGD hooks, and
fedcomp's codecs through ``fedcomp.distributed.compression_hook``, on the digits BatchNorm CNN.

Run: ``python benchmarks/ddp_hook.py [--steps 300] [--seeds 0 1 2] [--quick] [--out FILE]``.

Every side trains the same model from the same seed on the same data (2 gloo ranks on loopback, one
thread each, each rank its own shard of scikit-learn's digits, batch 32 per rank, SGD lr 0.05 with
momentum 0.9) for the same number of steps, one side after the other. Per side and rank:

- bytes: counted by wrapping ``torch.distributed.all_reduce`` / ``all_gather`` in the rank process,
  i.e. what the hook handed to the collectives (sizes and padding included), not the hook's own
  counters. DDP without a hook allreduces in C++, past the wrapper: its bytes are its buckets' fp32
  size, 4 bytes per gradient entry per step. DDP's broadcast of the BatchNorm buffers before each
  forward pass is the same for every side and not counted;
- time per step: the hook's time (encode + decode + communication, the hook's future waited for) and,
  inside it, the time in the collectives; compute is the rest of the step (forward, backward, optimizer);
- test loss and accuracy every ``--eval-every`` steps, with the wall time, and at the end.

Links are unshaped loopback: communication time here is latency and copies, not bandwidth; the bytes
are what a shaped link would carry. Prints a table and writes ``benchmarks/results/ddp_hook.json``
(``--quick``: a few steps, written to the temporary folder, never over the reference).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import pathlib
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from outputs import output_path, shown  # benchmarks/outputs.py: paths printed relative to the repository

# the example's model (examples/ddp/train.py), measured as users run it
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples" / "ddp"))
from train import DigitsBNCNN  # noqa: E402

#: (side name, kind, options); kind: "ddp" (no hook), "torch-fp16", "torch-bf16", "torch-powersgd", "fedcomp"
SIDES = [
    ("ddp (fp32 allreduce)", "ddp", {}),
    ("torch fp16 hook", "torch-fp16", {}),
    ("torch bf16 hook", "torch-bf16", {}),
    ("torch PowerSGD r1", "torch-powersgd", {"rank": 1}),
    ("torch PowerSGD r4", "torch-powersgd", {"rank": 4}),
    ("fedcomp sign", "fedcomp", {"compressor": "sign"}),
    ("fedcomp stc 0.01", "fedcomp", {"compressor": "stc", "density": 0.01}),
    ("fedcomp topk 0.01", "fedcomp", {"compressor": "topk", "density": 0.01}),
    ("fedcomp int8", "fedcomp", {"compressor": "int8"}),
    ("fedcomp qsgd", "fedcomp", {"compressor": "qsgd"}),
    ("fedcomp powersgd r4", "fedcomp", {"compressor": "powersgd", "rank": 4}),
]

#: the sides of --quick: one of each kind of hook
QUICK = [0, 1, 3, 6]


def digits(seed: int):
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    return x[order[360:]], y[order[360:]], x[order[:360]], y[order[:360]]


class Meter:
    """Bytes and seconds spent in the wrapped collectives (this process)."""

    def __init__(self) -> None:
        self.bytes, self.seconds = 0, 0.0

    def wrap(self, fn, count):
        def wrapped(*args, **kwargs):
            t0 = time.perf_counter()
            work = fn(*args, **kwargs)
            if kwargs.get("async_op") and work is not None:
                work.wait()  # measured here; the caller's wait returns at once
            self.seconds += time.perf_counter() - t0
            self.bytes += count(*args)
            return work
        return wrapped


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def wrap_collectives(meter: Meter) -> None:
    """Count in ``meter`` the bytes and seconds of every ``dist.all_reduce`` / ``dist.all_gather`` of this
    process (the tensor this rank contributes), hooks' and DDP's Python calls alike."""
    dist.all_reduce = meter.wrap(dist.all_reduce, lambda t, *a, **k: _tensor_bytes(t))
    dist.all_gather = meter.wrap(dist.all_gather, lambda outs, t, *a, **k: _tensor_bytes(t))


def _rank_main(rank: int, world: int, port: int, sides: list, cfg: dict, out: str) -> None:
    torch.set_num_threads(1)
    meter = Meter()
    wrap_collectives(meter)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    results = [train_side(rank, world, side, DigitsTask(cfg["seed"], rank, world), cfg, meter) for side in sides]
    torch.save(results, pathlib.Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


class DigitsTask:
    """What every side trains here: this rank's shard of the digits, the example's BatchNorm CNN, SGD (lr
    0.05, momentum 0.9), batch 32; test loss and accuracy on the 360 held-out images.

    A task for `train_side`: ``model()``, ``optimizer(params)``, ``batch(generator)``, ``loss(output,
    target)`` and ``evaluate(module)`` (``{"loss", "accuracy"}``, accuracy None where it means nothing).
    """

    batch_size = 32

    def __init__(self, seed: int, rank: int, world: int) -> None:
        x_train, y_train, self.x_test, self.y_test = digits(seed)
        shard = torch.arange(rank, len(y_train), world)
        self.x, self.y = x_train[shard], y_train[shard]

    def model(self) -> torch.nn.Module:
        return DigitsBNCNN()

    def optimizer(self, params) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)

    def batch(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, len(self.y), (self.batch_size,), generator=gen)
        return self.x[idx], self.y[idx]

    loss = staticmethod(F.cross_entropy)

    @torch.no_grad()
    def evaluate(self, module: torch.nn.Module) -> dict:
        logits = module(self.x_test)
        return {"loss": float(F.cross_entropy(logits, self.y_test)),
                "accuracy": float((logits.argmax(1) == self.y_test).float().mean())}


def attach_hook(ddp, kind: str, opts: dict, seed: int, hook_seconds: list[float]) -> None:
    """Register the side's communication hook on ``ddp`` (none for kind ``"ddp"``), each call timed into
    ``hook_seconds[0]`` up to its future's completion (so a hook's asynchronous collectives count too)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from fedcomp.distributed import CompressionState, compression_hook

    def timed(hook):
        def run(state, bucket):
            t0 = time.perf_counter()
            fut = hook(state, bucket)
            fut.wait()
            hook_seconds[0] += time.perf_counter() - t0
            return fut
        return run

    if kind == "torch-fp16":
        ddp.register_comm_hook(None, timed(default_hooks.fp16_compress_hook))
    elif kind == "torch-bf16":
        ddp.register_comm_hook(None, timed(default_hooks.bf16_compress_hook))
    elif kind == "torch-powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=opts["rank"],
                                            start_powerSGD_iter=2, min_compression_rate=2, random_seed=seed)
        ddp.register_comm_hook(state, timed(powerSGD_hook.powerSGD_hook))
    elif kind == "fedcomp":
        ddp.register_comm_hook(CompressionState(process_group=None, seed=seed, **opts), timed(compression_hook))


def train_side(rank: int, world: int, side: tuple, task, cfg: dict, meter: Meter, probe=None, on_eval=None,
               stop=None) -> dict:
    """Train one side of ``task`` (see `DigitsTask`) in this rank's process group for ``cfg["steps"]`` steps;
    its measurements, or ``{"error": ...}``.

    Per step: its seconds, the hook's, the collectives' and the bytes handed to them; every
    ``cfg["eval_every"]`` steps and at the end a point of the curve: the step, the seconds since the first
    step (``wall_s``) and the same without the evaluations (``train_s``), and ``task.evaluate``'s figures.
    ``probe``, if given, is called right before the first step and after the last (``"probe"``: both
    answers), e.g. to read an interface's byte counters around the training alone; ``on_eval``, if given,
    gets each point of the curve as it is made (progress); ``stop``, if given, too, and the side ends
    before ``cfg["steps"]`` once it returns True (it must answer alike on every rank).
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    _, kind, opts = side
    torch.manual_seed(cfg["seed"])
    model = task.model()
    numel = sum(p.numel() for p in model.parameters())
    single = kind == "torch-powersgd"  # torch's PowerSGD fails on gloo with several buckets
    ddp = DDP(model, bucket_cap_mb=1000.0 if single else 25.0)
    hook_seconds = [0.0]
    try:
        attach_hook(ddp, kind, opts, cfg["seed"], hook_seconds)
        opt = task.optimizer(ddp.parameters())
        gen = torch.Generator().manual_seed(cfg["seed"] * 1000 + rank)
        step_times, hook_times, comm_times, step_bytes, curve = [], [], [], [], []
        before = probe() if probe else None
        start, evaluating = time.perf_counter(), 0.0
        for step in range(1, cfg["steps"] + 1):
            x, y = task.batch(gen)
            ddp.train()
            b0, h0, c0, t0 = meter.bytes, hook_seconds[0], meter.seconds, time.perf_counter()
            opt.zero_grad()
            task.loss(ddp(x), y).backward()
            opt.step()
            step_times.append(time.perf_counter() - t0)
            hook_times.append(hook_seconds[0] - h0)
            comm_times.append(meter.seconds - c0)
            step_bytes.append(meter.bytes - b0 if kind != "ddp" else 4 * numel)
            if step % cfg["eval_every"] == 0 or step == cfg["steps"]:
                e0 = time.perf_counter()
                ddp.eval()
                point = task.evaluate(ddp.module)
                curve.append({"step": step, "wall_s": time.perf_counter() - start,
                              "train_s": e0 - start - evaluating, **point})
                evaluating += time.perf_counter() - e0
                if on_eval:
                    on_eval(curve[-1])
                if stop and stop(curve[-1]):
                    break
        after = probe() if probe else None
        params = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
        digest = torch.frombuffer(bytearray(hashlib.sha256(params.numpy().tobytes()).digest()), dtype=torch.uint8)
        gathered = [torch.empty_like(digest) for _ in range(world)]
        dist.all_gather(gathered, digest)
        return {"numel": numel, "step_s": step_times, "hook_s": hook_times, "comm_s": comm_times,
                "bytes": step_bytes, "curve": curve, "identical": all(torch.equal(g, digest) for g in gathered),
                **({"probe": {"before": before, "after": after}} if probe else {})}
    except Exception as err:  # noqa: BLE001 - a side that cannot run here is reported, not fatal
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_sides(sides: list, cfg: dict, world: int = 2) -> list[dict]:
    """Train every side, one after the other, on ``world`` ranks (one process each, one process group)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out:
        port = _free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, world, port, sides, cfg, out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(1800)
            if p.is_alive():
                p.kill()
                p.join()
        files = [pathlib.Path(out) / f"rank{r}.pt" for r in range(world)]
        if not all(f.exists() for f in files):
            raise RuntimeError(f"a rank died: exit codes {[p.exitcode for p in procs]}")
        per_rank = [torch.load(f, weights_only=False) for f in files]
    return [summarize([rank_results[i] for rank_results in per_rank], cfg) for i in range(len(sides))]


def summarize(results: list[dict], cfg: dict) -> dict:
    """One side's row from every rank's measurements: rank 0's bytes, times and curve; whether every
    rank's model is the same."""
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return {"error": errors[0]}
    r0, warm = results[0], cfg["skip"]
    dense = 4 * r0["numel"]
    def mean_ms(xs):
        return 1000 * statistics.fmean(xs[warm:])

    hook, comm, step = mean_ms(r0["hook_s"]), mean_ms(r0["comm_s"]), mean_ms(r0["step_s"])
    total = sum(r0["bytes"])
    return {
        "bytes_per_step": total / len(r0["bytes"]),
        "bytes_per_compressed_step": statistics.fmean(r0["bytes"][-max(1, len(r0["bytes"]) // 2):]),
        "ratio": dense * len(r0["bytes"]) / total,
        "ratio_per_compressed_step": dense / statistics.fmean(r0["bytes"][-max(1, len(r0["bytes"]) // 2):]),
        "step_ms": step, "hook_ms": hook, "comm_ms": comm, "encode_decode_ms": hook - comm,
        "compute_ms": step - hook, "final_loss": r0["curve"][-1]["loss"], "final_accuracy": r0["curve"][-1]["accuracy"],
        "curve": r0["curve"], "replicas_identical": all(r["identical"] for r in results), "numel": r0["numel"],
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--quick", action="store_true", help="20 steps of 4 sides, written to the temporary folder")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    steps = 20 if args.quick else args.steps
    path = output_path("ddp_hook", args.out, args.quick)
    runs = []
    for seed in args.seeds:
        cfg = {"steps": steps, "eval_every": min(args.eval_every, steps), "seed": seed, "skip": min(5, steps // 4)}
        sides = [SIDES[i] for i in QUICK] if args.quick else SIDES
        for side, res in zip(sides, run_sides(sides, cfg)):
            res.update({"side": side[0], "kind": side[1], "options": side[2], "seed": seed})
            runs.append(res)
            print(_line(res), flush=True)
    data = {"config": {"steps": steps, "seeds": args.seeds, "world_size": 2, "backend": "gloo", "link": "loopback",
                       "batch_per_rank": 32, "torch_threads_per_rank": 1, "torch": torch.__version__,
                       "timing_skips_first_steps": min(5, steps // 4)},
            "runs": runs}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    print(f"wrote {shown(path)}")


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['side']:22s} seed {r['seed']}  not run: {r['error']}"
    return (f"{r['side']:22s} seed {r['seed']}  {r['bytes_per_step'] / 1e3:9.2f} kB/step  {r['ratio']:7.1f}x  "
            f"compute {r['compute_ms']:6.2f} ms  enc+dec {r['encode_decode_ms']:6.2f} ms  comm {r['comm_ms']:6.2f} ms  "
            f"loss {r['final_loss']:.3f}  acc {100 * r['final_accuracy']:5.1f} %  identical {r['replicas_identical']}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
