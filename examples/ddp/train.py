"""DDP with fedcomp's codecs as the communication hook: a small BatchNorm CNN on scikit-learn's digits,
one process per worker, launched with torchrun.

    torchrun --nproc-per-node 2 examples/ddp/train.py --compressor stc --density 0.01

Two machines, A (10.0.0.1: hosts the rendezvous, rank 0) and B (10.0.0.2), joined through ``eth0``; on B
leave out ``--rdzv-conf is_host=1`` and give ``--local-addr 10.0.0.2``:

    GLOO_SOCKET_IFNAME=eth0 torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint 10.0.0.1:29500 --rdzv-id digits-ddp --rdzv-conf is_host=1 --local-addr 10.0.0.1 \\
        examples/ddp/train.py --compressor stc --density 0.01

The only change to a DDP script is two lines after wrapping the model::

    state = CompressionState(process_group=None, compressor="stc", density=0.01)
    ddp_model.register_comm_hook(state, compression_hook)

Every worker trains on its own shard of the 1,437 training images (the other 360 are the test split)
with SGD and momentum; DDP averages the gradients through the hook. Rank 0 prints a line every
``--log-every`` steps (train loss, test accuracy, MB this rank handed to the collectives, and the ratio
against DDP's fp32 allreduce of the same steps) and writes ``--metrics`` (JSON; default
``$FEDCOMP_RESULTS_ROOT/ddp/`` or ``~/fedcomp-results/ddp/``), which ends with every rank's
``parameter_digests`` (SHA-256 of its parameters, rank order: all equal when the replicas stayed
bit-identical). ``--compressor off`` trains with DDP's own allreduce (no hook), for comparison.

Backend: NCCL when CUDA is available (one GPU per process, ``LOCAL_RANK``), gloo on CPU. A rank that
fails makes the others fail after ``--timeout`` seconds at most, never hang.

This file imports nothing of fedcomp but ``fedcomp.distributed``: copy it into your project.
Needs ``pip install scikit-learn`` for the data.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import pathlib
import time

import torch
import torch.distributed as dist

# Imported before the process group exists: torch imports it lazily otherwise, and then its functions'
# ``group=group.WORLD`` defaults keep the group, and gloo's threads, alive past destroy_process_group(); a
# thread still releasing a tensor while Python shuts down aborts the process at exit.
import torch.distributed.nn
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fedcomp.distributed import CompressionState, compression_hook


class DigitsBNCNN(nn.Module):
    """Two 3x3 convolutions (16, 32 channels) with BatchNorm, 2x2 max pooling, a 64-unit hidden layer:
    1x8x8 images to 10 logits (38.5k parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def digits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's digits as ``(x_train, y_train, x_test, y_test)``: float32 images ``(n, 1, 8, 8)``
    in [0, 1], int64 labels; a seeded split of 360 test images."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    test, train = order[:360], order[360:]
    return x[train], y[train], x[test], y[test]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compressor", default="stc", help="fedcomp codec (stc, topk, sign, int8, qsgd, powersgd, "
                                                       "fp16, none, ...), or 'off' for DDP's own allreduce")
    p.add_argument("--density", type=float, default=None, help="fraction of entries kept (stc, topk, randomk)")
    p.add_argument("--rank", type=int, default=None, help="PowerSGD's rank")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="plain fp32 allreduce steps first (default: the hook's)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process on CPU")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any collective may wait for the others")
    p.add_argument("--metrics", type=pathlib.Path, default=None, help="metrics JSON (rank 0 writes it)")
    return p.parse_args(argv)


def default_metrics_path(compressor: str) -> pathlib.Path:
    root = pathlib.Path(os.environ.get("FEDCOMP_RESULTS_ROOT") or pathlib.Path.home() / "fedcomp-results")
    return root / "ddp" / f"{time.strftime('%Y%m%d-%H%M%S')}-{compressor}.json"


def parameter_digest(model: nn.Module) -> str:
    """SHA-256 of the model's parameters, in order: two ranks agree only if their replicas are bit-identical."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def write_json(path: pathlib.Path, data: dict) -> None:
    """Write ``data`` whole or not at all (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def main(argv=None) -> None:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    else:
        torch.set_num_threads(args.threads)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")

    x_train, y_train, x_test, y_test = digits(args.seed)
    shard = torch.arange(rank, len(y_train), world)  # every rank its own examples
    x_train, y_train = x_train[shard].to(device), y_train[shard].to(device)
    x_test, y_test = x_test.to(device), y_test.to(device)

    torch.manual_seed(args.seed)  # the same initial model on every rank (DDP also broadcasts rank 0's)
    model = DigitsBNCNN().to(device)
    ddp = DDP(model, device_ids=[local_rank] if cuda else None, bucket_cap_mb=args.bucket_cap_mb)
    state = None
    if args.compressor != "off":
        options = {k: v for k, v in {"density": args.density, "rank": args.rank}.items() if v is not None}
        state = CompressionState(process_group=None, compressor=args.compressor, warmup_steps=args.warmup_steps,
                                 seed=args.seed, **options)
        ddp.register_comm_hook(state, compression_hook)
    dense_step_bytes = 4 * sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)

    rows, start, loss_sum, seen = [], time.perf_counter(), 0.0, 0
    for step in range(1, args.steps + 1):
        ddp.train()
        idx = torch.randint(0, len(y_train), (args.batch_size,), generator=gen).to(device)
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x_train[idx]), y_train[idx])
        loss.backward()
        opt.step()
        loss_sum, seen = loss_sum + loss.item(), seen + 1
        if step % args.log_every == 0 or step == args.steps:
            ddp.eval()
            with torch.no_grad():
                logits = ddp.module(x_test)
                accuracy = float((logits.argmax(1) == y_test).float().mean())
                test_loss = float(F.cross_entropy(logits, y_test))
            sent = state.bytes.sent if state is not None else dense_step_bytes * step
            dense = state.bytes.dense if state is not None else dense_step_bytes * step
            row = {"step": step, "wall_s": round(time.perf_counter() - start, 3), "train_loss": loss_sum / seen,
                   "test_loss": test_loss, "accuracy": accuracy, "mb_sent": sent / 1e6, "ratio": dense / sent}
            rows.append(row)
            loss_sum, seen = 0.0, 0
            if rank == 0:
                print(f"step {step:5d}  loss {row['train_loss']:.4f}  acc {100 * accuracy:5.1f} %  "
                      f"sent {row['mb_sent']:8.3f} MB/rank  ratio {row['ratio']:7.1f}x vs fp32 allreduce  "
                      f"{row['wall_s']:6.1f} s", flush=True)
    digests = [None] * world  # every rank's, so rank 0 can record whether the replicas are identical
    dist.all_gather_object(digests, parameter_digest(model))
    if rank == 0:
        path = args.metrics or default_metrics_path(args.compressor)
        write_json(path, {"config": {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()}
                          | {"world_size": world, "backend": dist.get_backend()},
                          "hook": state.compression_stats() if state is not None else None, "rows": rows,
                          "final": rows[-1], "parameter_digests": digests})
        print(f"metrics: {path}")
    del ddp  # DDP holds the process group too: released, destroy_process_group() stops gloo's threads
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
