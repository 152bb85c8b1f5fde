"""Accuracy under differential privacy on the default federation (10 clients, Dirichlet 0.5,
STC 0.01 with error feedback, 50 rounds): DP-SGD calibrated to epsilon ~ 1, 3, 8 at delta = 1e-5,
and client-level / local DP at a few noise multipliers, through the same in-process driver as
``benchmarks/federated.py``.

Run: ``python benchmarks/privacy.py [--rounds 50] [--quick]``; prints a table and writes
``benchmarks/results/privacy.json`` (``--quick``: a file in the temporary folder, see ``outputs.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from federated import run_one  # noqa: E402  (same driver as the federated benchmark)
from outputs import output_path, shown  # noqa: E402

CASES = {
    "no DP": {},
    "dp-sgd eps~8": {"dp": "dp-sgd", "target-epsilon": 8.0},
    "dp-sgd eps~3": {"dp": "dp-sgd", "target-epsilon": 3.0},
    "dp-sgd eps~1": {"dp": "dp-sgd", "target-epsilon": 1.0},
    "client-level z=0.5": {"dp": "client-level", "clipping-norm": 1.0, "noise-multiplier": 0.5},
    "local z=0.5": {"dp": "local", "clipping-norm": 1.0, "noise-multiplier": 0.5},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--nodes", type=int, default=10)
    ap.add_argument("--cases", nargs="+", default=list(CASES))
    ap.add_argument("--quick", action="store_true", help="3 rounds, 3 nodes, two cases")
    ap.add_argument("--out", default=None,
                    help="JSON to write (default: the reference benchmarks/results/privacy.json; "
                    "with --quick a file in the temporary folder)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.nodes, args.cases = 3, 3, ["no DP", "dp-sgd eps~8"]
    logging.getLogger("flwr").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    rows = []
    for name in args.cases:
        rc = {"num-server-rounds": args.rounds, "compressor": "stc", "density": 0.01, **CASES[name]}
        t0 = time.perf_counter()
        rounds = run_one(rc, args.nodes)
        secs = time.perf_counter() - t0
        last = rounds[-1]
        eps = last.get("epsilon", last.get("epsilon-max"))
        if rc.get("dp") == "local":
            from fedcomp.privacy import LocalDP

            eps = LocalDP(rc["clipping-norm"], rc["noise-multiplier"]).epsilon(args.rounds, 1e-5)
        rows.append({"case": name, **CASES[name], "final_accuracy": last["accuracy"], "epsilon": eps,
                     "seconds": secs, "curve": [r["accuracy"] for r in rounds]})
        e = "-" if eps is None else ("inf" if math.isinf(eps) else f"{eps:.2f}")
        print(f"{name:<20} accuracy {last['accuracy']:.4f}  epsilon {e:>6} (delta 1e-5)  {secs:6.1f} s", flush=True)
    out = output_path("privacy", args.out, args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rounds": args.rounds, "nodes": args.nodes,
                               "rows": [{**r, "epsilon": None if r["epsilon"] is None or math.isinf(r["epsilon"])
                                         else r["epsilon"]} for r in rows]}, indent=1))
    print(f"wrote {shown(out)}")


if __name__ == "__main__":
    main()
