"""Run a function on several gloo ranks, each a spawned process, and collect what each returned.

``run_ranks(fn, world)`` starts ``world`` processes (``torch.multiprocessing``'s spawn context), each with
one thread, a process group on a free 127.0.0.1 port and a timeout on every collective; ``fn(rank, world)``
runs in each and its return value (or its exception, as text) comes back in rank order. A rank still
running after ``timeout`` seconds is killed and reported as hung: a test asserts that none did.

Also here: the small models the tests share (a BatchNorm CNN, and one that DDP splits into several
buckets) and their data.
"""

from __future__ import annotations

import datetime
import socket
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch import nn


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world: int, port: int, out: str, collective_timeout: float, args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: dict
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=collective_timeout))
        result = {"value": fn(rank, world, *args)}
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which asserts on it
        result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    torch.save(result, Path(out) / f"rank{rank}.pt")
    if "value" in result and dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 90.0, collective_timeout: float = 30.0) -> list[dict]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; one dict per rank, in rank order.

    Each dict holds ``"value"`` (what ``fn`` returned), or ``"error"`` (``"Type: message"``) and
    ``"traceback"``, or only ``"exitcode"`` for a rank that died without reporting (``"hung": True`` for
    one killed after ``timeout`` seconds). ``fn`` must be a module-level function (spawn pickles it).
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        procs = [ctx.Process(target=_entry, args=(fn, r, world, port, out, collective_timeout, args))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        hung = []
        for r, p in enumerate(procs):
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                hung.append(r)
        for r in hung:  # only our own children, by their Process object
            procs[r].kill()
            procs[r].join(5)
        results = []
        for r, p in enumerate(procs):
            f = Path(out) / f"rank{r}.pt"
            res = torch.load(f, weights_only=False) if f.exists() else {}
            res["exitcode"] = p.exitcode
            if r in hung:
                res["hung"] = True
            results.append(res)
        return results


def values(results: list[dict]) -> list:
    """Every rank's return value; fails with the ranks' errors when one did not return."""
    bad = [(r, res.get("traceback") or res) for r, res in enumerate(results) if "value" not in res]
    assert not bad, "\n".join(f"rank {r}: {why}" for r, why in bad)
    return [res["value"] for res in results]


class BNCNN(nn.Module):
    """A small CNN with BatchNorm for 1x8x8 images, 10 classes (about 6.6k parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(16 * 4 * 4, 24), nn.ReLU(), nn.Linear(24, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


#: DDP's bucket_cap_mb that splits BNCNN into three buckets (a bucket closes past about 520 fp32 entries)
SMALL_BUCKET_MB = 0.002


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """BNCNN with seeded weights (every rank builds the same one)."""
    torch.manual_seed(seed)
    return BNCNN().to(dtype)


def batch(rank: int, step: int, size: int = 16, dtype: torch.dtype = torch.float32):
    """Seeded random images and labels, different per rank and step."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(size, 1, 8, 8, generator=g).to(dtype), torch.randint(0, 10, (size,), generator=g)


def train(ddp: nn.Module, rank: int, steps: int, *, start: int = 0, lr: float = 0.05, opt=None,
          dtype: torch.dtype = torch.float32) -> torch.optim.Optimizer:
    """``steps`` SGD steps (momentum 0.9) of cross-entropy on :func:`batch`; returns the optimizer."""
    opt = opt or torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    for step in range(start, start + steps):
        x, y = batch(rank, step, dtype=dtype)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x).float(), y).backward()
        opt.step()
    return opt


def flat_params(model: nn.Module) -> torch.Tensor:
    """Every parameter and buffer of ``model``, flattened and concatenated as float64."""
    return torch.cat([t.detach().double().reshape(-1) for t in model.state_dict().values()])
