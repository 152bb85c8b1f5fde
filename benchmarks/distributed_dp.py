"""Distributed DP under SecAgg+ (Skellam shares on the clients) against central client-level DP at
the same epsilon and delta: final accuracy, epsilon, bits per parameter.

A block of rows per target epsilon after ``--rounds`` rounds (delta 1e-5, clipping norm C = 1,
no amplification by sampling), default CNN on sklearn digits, ``--nodes`` clients, Dirichlet 0.5,
dense updates (``--density`` < 1: shared-seed random-k) without error feedback:

- central client-level DP without SecAgg (``dp = "client-level"``, the server sees every update);
- central client-level DP under SecAgg+ (the server adds Gaussian noise to the unmasked sum, with
  rotation: the pipeline of the next row but for where the noise is added);
- distributed DP under SecAgg+ (``dp = "distributed"``, rotation: each client adds its Skellam share,
  sized for the round's SecAgg+ threshold; the server never sees an un-noised sum).

Each row's noise multiplier is calibrated (bisection) so that its own accountant reports the target
epsilon after the last round with every sampled client in every sum (no dropouts in process): the
Gaussian RDP for the central rows, the Skellam RDP of n shares sized for threshold t for the
distributed row. ``secagg-clipping-range`` of the distributed row is the smallest that keeps a
client's noisy values inside it (:func:`fedcomp.privacy.distributed.min_clipping_range`).

Run: ``python benchmarks/distributed_dp.py [--rounds 20] [--nodes 10] [--seeds 42 43 44]
[--epsilons 50 200]`` (``--quick``: 2 rounds, 4 clients, one seed; writes to a temporary file unless
``--out``, see ``benchmarks/outputs.py``). Prints a table and writes
``benchmarks/results/distributed_dp.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from federated import run_one  # noqa: E402
from outputs import output_path, shown  # noqa: E402
from secagg import N_PARAMS, run_secure  # noqa: E402

from fedcomp.compression.sparse import k_for  # noqa: E402
from fedcomp.config.secagg import majority_threshold  # noqa: E402
from fedcomp.privacy.client_level import ClientLevelDP  # noqa: E402
from fedcomp.privacy.distributed import DistributedDP, min_clipping_range  # noqa: E402

DELTA, CLIP, QBITS = 1e-5, 1.0, 16


def _bisect(eps_of, target: float) -> float:
    """The noise multiplier z whose epsilon (decreasing in z) is ``target``, to 1e-4 relative."""
    lo, hi = 1e-3, 100.0
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if eps_of(mid) > target else (lo, mid)
    return hi


def central_z(target: float, rounds: int) -> float:
    """Gaussian client-level DP (no amplification): z with epsilon(rounds) = target."""
    return _bisect(lambda z: ClientLevelDP(CLIP, z, DELTA).epsilon(rounds), target)


def secagg_threshold(nodes: int, fraction: float = 0.7) -> int:
    """Flower's threshold for shares = every sampled client, raised to a majority as the workflow does."""
    t = max(round(fraction * nodes), 2)
    return max(t, majority_threshold(nodes)) if 2 * t <= nodes else t


def distributed_setup(target: float, rounds: int, nodes: int, density: float) -> tuple[float, float]:
    """(z, secagg-clipping-range) of the distributed row: the Skellam accountant of ``nodes`` shares
    sized for the threshold reports ``target`` after ``rounds`` rounds."""
    t, k, q = secagg_threshold(nodes), k_for(density, N_PARAMS), 1 << QBITS

    def eps(z: float) -> float:
        c = min_clipping_range(CLIP, z, t, q)
        ddp = DistributedDP(CLIP, z, c, q, DELTA)
        rdp = ddp.round_rdp(k, nodes, t) * rounds
        from fedcomp.privacy.accounting import epsilon_from_rdp
        from fedcomp.privacy.distributed import SKELLAM_ORDERS

        return epsilon_from_rdp(SKELLAM_ORDERS, rdp, DELTA)

    z = _bisect(eps, target)
    return z, min_clipping_range(CLIP, z, t, q)


def summarize(label: str, runs: list[list[dict]], secure: bool, z: float, extra: dict) -> dict:
    """Median final accuracy over seeds, epsilon of the last round, bits per parameter per client."""
    finals = [r[-1]["accuracy"] for r in runs]
    trained = [x for r in runs for x in r if x["round"] > 0]
    up = statistics.median(x["upload-bytes"] for x in trained)
    replies = statistics.median(x.get("num-replies", len(x.get("clients", [])) or 1) for x in trained)
    return {"label": label, "secure": secure, "noise-multiplier": z, **extra,
            "final-accuracy": statistics.median(finals), "finals": finals,
            "epsilon": statistics.median(r[-1]["epsilon"] for r in runs), "delta": DELTA,
            "bits-per-parameter": 8 * up / (replies * N_PARAMS)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--nodes", type=int, default=10)
    ap.add_argument("--seeds", type=int, nargs="+", default=[42])
    ap.add_argument("--epsilons", type=float, nargs="+", default=[50.0, 200.0],
                    help="target epsilons after the last round (one block of rows each)")
    ap.add_argument("--density", type=float, default=1.0, help="1 = dense (compressor none), else shared random-k")
    ap.add_argument("--quick", action="store_true", help="2 rounds, 4 clients, one seed (smoke test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.nodes, args.seeds = 2, 4, args.seeds[:1]
    out = output_path("distributed_dp", args.out, args.quick)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    codec = {"compressor": "none"} if args.density >= 1 else {"compressor": "randomk", "density": args.density}
    base = {"num-server-rounds": args.rounds, "lr": 0.1, **codec, "error-feedback": False, "clipping-norm": CLIP,
            "target-delta": DELTA}
    secure = {"secagg": True, "secagg-shares": 1.0, "secagg-threshold": 0.7, "secagg-rotation": True,
              "secagg-quantization-bits": QBITS}
    rows, gaps, t0 = [], {}, time.perf_counter()
    print(f"{'configuration':<54} {'z':>6} {'epsilon':>8} {'bits/p':>7} {'final acc':>9}  ({args.nodes} clients, "
          f"{args.rounds} rounds, seeds {args.seeds}, delta {DELTA:g})")
    for target in args.epsilons:
        zc = central_z(target, args.rounds)
        zd, cd = distributed_setup(target, args.rounds, args.nodes, args.density)
        cases = [
            ("central client-level DP, no SecAgg", False, {"dp": "client-level", "noise-multiplier": zc}, zc),
            ("central client-level DP under SecAgg+ (server noise)", True,
             {**secure, "dp": "client-level", "noise-multiplier": zc}, zc),
            ("distributed DP under SecAgg+ (Skellam shares)", True,
             {**secure, "dp": "distributed", "noise-multiplier": zd, "secagg-clipping-range": cd}, zd),
        ]
        block = []
        for label, sec, extra, z in cases:
            runs = []
            for seed in args.seeds:
                rc = {**base, **extra, "seed": seed}
                runs.append(run_secure(rc, args.nodes) if sec else run_one(rc, args.nodes))
            ddp = extra["dp"] == "distributed"  # the sum of n shares sized for t: std z * sqrt(n / t) * C
            cfg_extra = {"target-epsilon": target,
                         "sum-noise-std-over-clip": (z * math.sqrt(args.nodes / secagg_threshold(args.nodes)) if ddp
                                                     else z),
                         **({"secagg-clipping-range": extra["secagg-clipping-range"]} if ddp else {})}
            row = summarize(label, runs, sec, z, cfg_extra)
            block.append(row)
            print(f"{label:<54} {z:>6.3f} {row['epsilon']:>8.2f} {row['bits-per-parameter']:>7.3f} "
                  f"{row['final-accuracy']:>9.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
        gaps[f"{target:g}"] = {
            "central-secagg-minus-distributed": block[1]["final-accuracy"] - block[2]["final-accuracy"],
            "central-plain-minus-distributed": block[0]["final-accuracy"] - block[2]["final-accuracy"]}
        print(f"epsilon {target:g}: gap in final accuracy, central (under SecAgg+) minus distributed: "
              f"{gaps[f'{target:g}']['central-secagg-minus-distributed']:+.4f}")
        rows += block
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = "python benchmarks/distributed_dp.py " + " ".join(
        a for a in (f"--rounds {args.rounds}", f"--nodes {args.nodes}", "--seeds " + " ".join(map(str, args.seeds)),
                    "--epsilons " + " ".join(f"{e:g}" for e in args.epsilons), f"--density {args.density:g}",
                    "--quick" if args.quick else "") if a)
    out.write_text(json.dumps({"command": cmd, "nodes": args.nodes, "rounds": args.rounds, "seeds": args.seeds,
                               "delta": DELTA, "clipping-norm": CLIP, "density": args.density,
                               "threshold": secagg_threshold(args.nodes), "gaps": gaps, "rows": rows}, indent=1))
    print(f"wrote {shown(out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
