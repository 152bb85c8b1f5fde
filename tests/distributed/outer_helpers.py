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


def overlap_identical(rank, world, cases, sync_every, steps, fragments, overlap, mixing=0.0):
    """Streaming with ``overlap`` steps: per case, after every step whether the outer copies were
    bit-identical across ranks, whether every landed fragment's parameters were exactly the merge
    ``mixing * local + (1 - mixing) * outer copy`` (with mixing 0: the outer copy, and identical
    across ranks), the (begun, landed) inner steps of each exchange, and the same after ``flush``."""
    from fedcomp.distributed import DiLoCo

    out = {}
    for name, options in cases.items():
        torch.manual_seed(rank + 1)
        model = mlp()
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        outer = DiLoCo(model, inner, compressor=name, sync_every=sync_every, fragments=fragments,
                       overlap_steps=overlap, mixing=mixing, **options)
        begun, landed, starts_same, merged, params_same, drifted = {}, [], True, True, True, False

        def check_landed(local):
            nonlocal merged, params_same
            for f in outer.synced:
                landed.append((f, outer.inner_steps))
                for i in outer.groups[f]:
                    p, s = outer.params[i].detach(), outer.starts[i]
                    want = s.clone() if not mixing else local[i].mul_(mixing).add_(s, alpha=1 - mixing)
                    merged &= torch.equal(p, want)
                    if not mixing:
                        params_same &= same_on_every_rank(p.clone())

        for t in range(steps):
            x, y = batch(rank, t)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            inner.step()
            inner.zero_grad()
            drifted |= not same_on_every_rank(flat_state(model))
            local = [p.detach().clone() for p in outer.params]
            outer.step()
            for f in outer.started:
                begun.setdefault(f, []).append(outer.inner_steps)
            check_landed(local)
            starts_same &= same_on_every_rank(torch.cat([s.reshape(-1) for s in outer.starts]))
        in_flight = len(outer._in_flight)
        local = [p.detach().clone() for p in outer.params]
        outer.flush()
        check_landed(local)
        starts_same &= same_on_every_rank(torch.cat([s.reshape(-1) for s in outer.starts]))
        out[name] = {"starts_same": starts_same, "merged": merged, "params_same": params_same, "drifted": drifted,
                     "begun": begun, "landed": landed, "in_flight_at_end": in_flight,
                     "outer_steps": outer.outer_steps, "sent": outer.bytes.sent}
    return out


def telescoping(rank, world, sync_every, outer_steps, overlap=0):
    """STC with error feedback, outer SGD lr 1: applied means + mean residual == mean pseudo-gradients."""
    from fedcomp.distributed import DiLoCo

    torch.manual_seed(0)
    model = mlp(batchnorm=False)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = DiLoCo(model, inner, compressor="stc", density=0.05, sync_every=sync_every, overlap_steps=overlap,
                   outer_optimizer=functools.partial(torch.optim.SGD, lr=1.0, momentum=0.0))

    def vec(tensors):
        return torch.cat([t.detach().reshape(-1).clone() for t in tensors])

    sum_delta, sum_applied, sent_entries = 0.0, 0.0, []

    def landed(start):
        nonlocal sum_applied
        new = vec(outer.starts)
        sum_applied = sum_applied + (start - new)
        sent_entries.append(int((start - new != 0).sum()))

    for t in range(sync_every * outer_steps):
        train_step(model, inner, rank, t)
        start, now = vec(outer.starts), vec(model.parameters())
        outer.step()
        if outer.started:  # the pseudo-gradient sent: outer copy - parameters at this step
            sum_delta = sum_delta + (start - now)
        if outer.synced:
            landed(start)
    start = vec(outer.starts)
    if outer.flush():  # with overlap the last exchange is still in flight
        landed(start)
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


def checkpoint_resume(rank, world, name, options, sync_every, fragments, stop, end, overlap=0):
    """Train to ``stop``, checkpoint, go on to ``end``; then a fresh model, optimizers and DiLoCo
    loaded from the checkpoint (through torch.save/torch.load weights_only) go from ``stop`` to ``end``.
    With ``overlap``, the exchanges in flight at ``stop`` are counted, and both runs ``flush()`` at ``end``."""
    from fedcomp.distributed import DiLoCo

    def build(seed, every=sync_every, overlap_steps=overlap):
        torch.manual_seed(seed)
        model = mlp()
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return model, inner, DiLoCo(model, inner, compressor=name, sync_every=every, fragments=fragments,
                                    overlap_steps=overlap_steps, **options)

    model, inner, outer = build(0)
    _run(rank, model, inner, outer, range(stop))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "inner": inner.state_dict(), "outer": outer.state_dict()}, buf)
    pending = len(outer._in_flight)
    _run(rank, model, inner, outer, range(stop, end))
    outer.flush()
    first = (flat_state(model), outer.outer_steps, outer.bytes.sent)

    model2, inner2, outer2 = build(99)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model2.load_state_dict(ckpt["model"])
    inner2.load_state_dict(ckpt["inner"])
    outer2.load_state_dict(ckpt["outer"])
    _run(rank, model2, inner2, outer2, range(stop, end))
    outer2.flush()
    second = (flat_state(model2), outer2.outer_steps, outer2.bytes.sent)

    refused = []
    for every, overlap_steps in ((sync_every + 1, overlap), (sync_every, (overlap + 1) % sync_every)):
        o3 = build(7, every, overlap_steps)[2]
        try:
            o3.load_state_dict(ckpt["outer"])
            refused.append("")
        except ValueError as exc:
            refused.append(str(exc))
    return {"equal": torch.equal(first[0], second[0]), "outer_steps": (first[1], second[1]),
            "sent": (first[2], second[2]), "refused": refused, "moved": bool((first[0] != 0).any()),
            "pending": pending}


def nan_pseudo_gradient(rank, world, overlap=0):
    """Rank 1's parameters turn NaN before the outer step: every rank raises naming the codec (with
    ``overlap``: at the step where the update would land); the message, and that step."""
    from fedcomp.distributed import DiLoCo

    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = DiLoCo(model, inner, compressor="int8", sync_every=2, overlap_steps=overlap)
    train_step(model, inner, rank, 0)
    outer.step()
    train_step(model, inner, rank, 1)
    if rank == 1:
        with torch.no_grad():
            next(model.parameters())[0, 0] = float("nan")
    try:
        for t in range(2, 2 + overlap + 1):
            outer.step()
            train_step(model, inner, rank, t)
    except ValueError as exc:
        return {"message": "\n".join([str(exc), *getattr(exc, "__notes__", [])]), "step": outer.inner_steps}
    return {"message": "no error", "step": outer.inner_steps}


def dead_worker(rank, world, overlap=0):
    """Rank 1 dies after the first outer step; rank 0's next one raises (within the collective
    timeout) instead of hanging. With ``overlap`` (no buffers: only the exchange thread talks to the
    dead rank) the step where the update would land raises."""
    from fedcomp.distributed import DiLoCo

    model = mlp(batchnorm=not overlap)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = DiLoCo(model, inner, compressor="stc", density=0.1, sync_every=2, overlap_steps=overlap)
    _run(rank, model, inner, outer, range(2 + overlap))
    if rank == 1:
        os._exit(3)
    began = time.monotonic()
    try:
        _run(rank, model, inner, outer, range(2 + overlap, 6))
    except Exception as exc:  # noqa: BLE001 - what the user would see
        return {"raised": type(exc).__name__, "message": str(exc)[:300], "seconds": time.monotonic() - began,
                "step": outer.inner_steps}
    return {"raised": None}
