"""Multi-process workers for ``test_outer.py``: every rank in its own spawned process, gloo on
127.0.0.1 with a free port, one thread per rank, a timeout on every collective.

``launch(worker, world, *args)`` returns ``[(status, value)]`` per rank: ``("ok", value)``,
``("error", traceback text)`` or ``("exited", exit code)`` for a rank that ended without reporting.
Values travel as plain Python/numpy objects.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import io
import os
import queue
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(worker, rank, world, port, backend, collective_timeout, results, args):
    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=collective_timeout))
        value = worker(rank, world, *args)
        results.put((rank, "ok", value))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, "error", traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):  # a peer may be gone already
            if dist.is_initialized():
                dist.destroy_process_group()


def launch(worker, world: int, *args, timeout: float = 100.0, backend: str = "gloo",
           collective_timeout: float = 30.0) -> list[tuple[str, object]]:
    """Run ``worker(rank, world, *args)`` on ``world`` spawned ranks; their results by rank.

    Raises
    ------
    TimeoutError
        A rank neither reported nor exited within ``timeout`` seconds (a hang); every rank is killed.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(worker, r, world, port, backend, collective_timeout, results, args),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(got))} hung for {timeout} s")
            try:
                rank, status, value = results.get(timeout=0.5)
                got[rank] = (status, value)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in got and p.exitcode is not None:
                        try:  # what it put may still be on its way
                            rank, status, value = results.get(timeout=2.0)
                            got[rank] = (status, value)
                        except queue.Empty:
                            got[r] = ("exited", p.exitcode)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [got[r] for r in range(world)]


def values(results: list[tuple[str, object]]) -> list[object]:
    """Each rank's value; a rank's traceback as the assertion message when one failed."""
    bad = [f"rank {r}: {status}: {value}" for r, (status, value) in enumerate(results) if status != "ok"]
    assert not bad, "\n".join(bad)
    return [value for _, value in results]


# -- models and data -----------------------------------------------------------------------------

def mlp(batchnorm: bool = True) -> torch.nn.Module:
    """A small MLP (8 -> 16 -> 4), with a BatchNorm (float running stats, int64 counter) if asked."""
    layers = [torch.nn.Linear(8, 16)] + ([torch.nn.BatchNorm1d(16)] if batchnorm else []) + \
        [torch.nn.ReLU(), torch.nn.Linear(16, 4)]
    return torch.nn.Sequential(*layers)


def batch(rank: int, step: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of inner step ``step`` (the same in every run)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(size, 8, generator=g), torch.randint(0, 4, (size,), generator=g)


def train_step(model, opt, rank, step) -> float:
    x, y = batch(rank, step)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def flat_state(model) -> torch.Tensor:
    """Every parameter and buffer of ``model`` as one float64 vector (exact for fp32 and int64 counters)."""
    return torch.cat([t.detach().reshape(-1).double() for t in [*model.parameters(), *model.buffers()]])


def same_on_every_rank(t: torch.Tensor) -> bool:
    """Whether ``t`` is bit-identical on every rank."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return all(torch.equal(parts[0], p) for p in parts[1:])


# -- workers -------------------------------------------------------------------------------------

def ddp_vs_diloco(rank, world, steps):
    """H = 1, codec none, outer SGD lr 1 without momentum against DDP; the largest difference per step."""
    from fedcomp.distributed import DiLoCo

    torch.manual_seed(0)
    model = mlp(batchnorm=False)
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=0.1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = DiLoCo(model, inner, compressor="none", sync_every=1,
                   outer_optimizer=functools.partial(torch.optim.SGD, lr=1.0, momentum=0.0))
    diffs = []
    for t in range(steps):
        train_step(ddp, opt_ddp, rank, t)
        train_step(model, inner, rank, t)
        assert outer.step()
        diffs.append(max(float((a - b).abs().max()) for a, b in zip(ddp.module.parameters(), model.parameters())))
    return {"diffs": diffs, "sent": outer.bytes.sent, "dense": outer.bytes.dense,
            "numel": sum(p.numel() for p in model.parameters())}


CODEC_CASES = {
    "none": {}, "int8": {"seed": 3}, "sign": {"buffers": "mean"}, "stc": {"density": 0.1}, "topk": {"density": 0.1},
    "qsgd": {"seed": 5},
}


def identical_after_outer_steps(rank, world, cases, sync_every, steps, fragments=1, device="cpu"):
    """Per case: whether the ranks' models were bit-identical after every outer step, how many outer
    steps were checked, and whether they had drifted apart before the steps (the check bites)."""
    from fedcomp.distributed import DiLoCo

    if device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    out = {}
    for name, options in cases.items():
        torch.manual_seed(rank + 1)  # different on every rank: DiLoCo starts from rank 0's
        model = mlp().to(device)
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        outer = DiLoCo(model, inner, compressor=name, sync_every=sync_every, fragments=fragments, **options)
        checks, identical, drifted = 0, True, False
        for t in range(steps):
            x, y = (v.to(device) for v in batch(rank, t))
            torch.nn.functional.cross_entropy(model(x), y).backward()
            inner.step()
            inner.zero_grad()
            drifted |= not same_on_every_rank(flat_state(model))
            if outer.step():
                checks += 1
                synced = [outer.params[i] for f in outer.synced for i in outer.groups[f]]
                if fragments - 1 in outer.synced:  # the interval's last fragment: the buffers are averaged too
                    synced += list(model.buffers())
                # streaming: only the fragments just synchronised are identical
                state = torch.cat([t.detach().reshape(-1).double() for t in synced])
                identical &= same_on_every_rank(state)
        out[name] = {"identical": identical, "checks": checks, "drifted": drifted,
                     "ratio": outer.bytes.ratio, "error_feedback": outer.error_feedback}
    return out


def telescoping(rank, world, sync_every, outer_steps):
    """STC with error feedback, outer SGD lr 1: applied means + mean residual == mean pseudo-gradients."""
    from fedcomp.distributed import DiLoCo

    torch.manual_seed(0)
    model = mlp(batchnorm=False)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = DiLoCo(model, inner, compressor="stc", density=0.05, sync_every=sync_every,
                   outer_optimizer=functools.partial(torch.optim.SGD, lr=1.0, momentum=0.0))

    def vec():
        return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])

    start, sum_delta, sum_applied, sent_entries = vec(), 0.0, 0.0, []
    for t in range(sync_every * outer_steps):
        train_step(model, inner, rank, t)
        now = vec()
        if outer.step():
            new = vec()
            sum_delta = sum_delta + (start - now)
            sum_applied = sum_applied + (start - new)
            sent_entries.append(int((start - new != 0).sum()))
            start = new
    residual = outer.state_dict()["feedback"][0]["residual"].reshape(-1)
    mean_delta, mean_residual = sum_delta.clone(), residual.clone()
    for t in (mean_delta, mean_residual):
        dist.all_reduce(t)
        t /= world
    gap = float((sum_applied + mean_residual - mean_delta).abs().max())
    return {"gap": gap, "residual_norm": float(residual.norm()), "delta_norm": float(sum_delta.norm()),
            "sent_entries": sent_entries, "numel": residual.numel()}


def _run(rank, model, inner, outer, steps):
    for t in steps:
        train_step(model, inner, rank, t)
        outer.step()


def checkpoint_resume(rank, world, name, options, sync_every, fragments, stop, end):
    """Train to ``stop``, checkpoint, go on to ``end``; then a fresh model, optimizers and DiLoCo
    loaded from the checkpoint (through torch.save/torch.load weights_only) go from ``stop`` to ``end``."""
    from fedcomp.distributed import DiLoCo

    def build(seed):
        torch.manual_seed(seed)
        model = mlp()
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return model, inner, DiLoCo(model, inner, compressor=name, sync_every=sync_every, fragments=fragments,
                                    **options)

    model, inner, outer = build(0)
    _run(rank, model, inner, outer, range(stop))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "inner": inner.state_dict(), "outer": outer.state_dict()}, buf)
    _run(rank, model, inner, outer, range(stop, end))
    first = (flat_state(model), outer.outer_steps, outer.bytes.sent)

    model2, inner2, outer2 = build(99)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model2.load_state_dict(ckpt["model"])
    inner2.load_state_dict(ckpt["inner"])
    outer2.load_state_dict(ckpt["outer"])
    _run(rank, model2, inner2, outer2, range(stop, end))
    second = (flat_state(model2), outer2.outer_steps, outer2.bytes.sent)

    refused = ""
    m3 = mlp()
    o3 = DiLoCo(m3, torch.optim.SGD(m3.parameters(), lr=0.1), compressor=name, sync_every=sync_every + 1,
                fragments=fragments, **options)
    try:
        o3.load_state_dict(ckpt["outer"])
    except ValueError as exc:
        refused = str(exc)
    return {"equal": torch.equal(first[0], second[0]), "outer_steps": (first[1], second[1]),
            "sent": (first[2], second[2]), "refused": refused, "moved": bool((first[0] != 0).any())}


def nan_pseudo_gradient(rank, world):
    """Rank 1's parameters turn NaN before the outer step: every rank raises naming the codec."""
    from fedcomp.distributed import DiLoCo

    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = DiLoCo(model, inner, compressor="int8", sync_every=2)
    train_step(model, inner, rank, 0)
    outer.step()
    train_step(model, inner, rank, 1)
    if rank == 1:
        with torch.no_grad():
            next(model.parameters())[0, 0] = float("nan")
    try:
        outer.step()
    except ValueError as exc:
        return str(exc)
    return "no error"


def dead_worker(rank, world):
    """Rank 1 dies after the first outer step; rank 0's next one raises (within the collective
    timeout) instead of hanging."""
    from fedcomp.distributed import DiLoCo

    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = DiLoCo(model, inner, compressor="stc", density=0.1, sync_every=2)
    _run(rank, model, inner, outer, range(2))
    if rank == 1:
        os._exit(3)
    began = time.monotonic()
    try:
        _run(rank, model, inner, outer, range(2, 4))
    except Exception as exc:  # noqa: BLE001 - what the user would see
        return {"raised": type(exc).__name__, "message": str(exc)[:300], "seconds": time.monotonic() - began}
    return {"raised": None}
