"""DP-SGD overhead: local training time of the default CNN on one digits partition, with and
without Opacus DP-SGD (per-sample gradients, clipping, noise, Poisson sampling).

Run: ``python benchmarks/dp_sgd.py [--epochs 5] [--repeats 7] [--threads 1]``.
Prints a table and writes ``benchmarks/results/dp_sgd.json``. Both sides are measured in this
one process, interleaved (the machines are shared and noisy); times are medians over repeats.
"DP round" is everything ``train_dp_sgd`` does in a round (fresh private copy, PrivacyEngine,
training, copy-back, epsilon query); "DP train only" is its training loop alone. Target: the
DP round costs at most 5x the plain round.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
import warnings

import torch

from fedcomp.privacy.dp_sgd import make_private, run_epochs, train_dp_sgd
from fedcomp.task.data import DataConfig, load_partition
from fedcomp.task.models import build_model
from fedcomp.privacy import DPSGDConfig
from fedcomp.task.training import TrainConfig, train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=5, help="local epochs per round")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--partitions", type=int, default=10)
    ap.add_argument("--partition-id", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--accumulation-steps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is)")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "dp_sgd.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    device = torch.device("cpu")
    data = load_partition(DataConfig(), args.partition_id, args.partitions)
    tc = TrainConfig(local_epochs=args.epochs, batch_size=args.batch_size,
                     accumulation_steps=args.accumulation_steps, lr=0.1, momentum=0.9)
    dc = DPSGDConfig(noise_multiplier=1.0, max_grad_norm=1.0)
    model = build_model()

    def plain_round(seed: int) -> float:
        t0 = time.perf_counter()
        train(model, data, tc, device, seed=seed)
        return time.perf_counter() - t0

    state = {"acc": None}

    def dp_round(seed: int) -> float:
        t0 = time.perf_counter()
        _, _, eps, state["acc"] = train_dp_sgd(model, data, dc, device, lr=tc.lr, momentum=tc.momentum,
                                               batch_size=tc.batch_size, accumulation_steps=tc.accumulation_steps,
                                               local_epochs=tc.local_epochs, seed=seed, accountant_state=state["acc"])
        state["eps"] = eps
        return time.perf_counter() - t0

    def dp_train_only(seed: int) -> float:
        private = make_private(model, data, dc, device, lr=tc.lr, momentum=tc.momentum,
                               logical_batch=tc.batch_size * tc.accumulation_steps, local_epochs=tc.local_epochs,
                               seed=seed)
        t0 = time.perf_counter()
        run_epochs(private, tc.local_epochs, tc.batch_size, device)
        return time.perf_counter() - t0

    for fn in (plain_round, dp_round, dp_train_only):  # warm-up (allocator, RDP cache)
        fn(0)
    times: dict[str, list[float]] = {"plain": [], "dp_round": [], "dp_train_only": []}
    for r in range(1, args.repeats + 1):
        times["plain"].append(plain_round(r))
        times["dp_round"].append(dp_round(r))
        times["dp_train_only"].append(dp_train_only(r))
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "examples": len(data), "local_epochs": args.epochs, "batch_size": args.batch_size,
        "accumulation_steps": args.accumulation_steps, "threads": torch.get_num_threads(),
        "repeats": args.repeats, "median_seconds": med,
        "ratio_dp_round_over_plain": med["dp_round"] / med["plain"],
        "ratio_dp_train_only_over_plain": med["dp_train_only"] / med["plain"],
        "epsilon_after_benchmark_rounds": state["eps"], "target_ratio": 5.0,
    }
    print(f"digits partition {args.partition_id}/{args.partitions}: {len(data)} examples, "
          f"{args.epochs} local epochs, batch {args.batch_size}x{args.accumulation_steps}, "
          f"{torch.get_num_threads()} thread(s), median of {args.repeats}")
    print(f"{'case':<16}{'seconds':>10}{'x plain':>10}")
    for k in ("plain", "dp_round", "dp_train_only"):
        print(f"{k:<16}{med[k]:>10.4f}{med[k] / med['plain']:>10.2f}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
