"""Compressed updates under Flower's SecAgg+: bits per parameter on the wire and accuracy.

Rows: plain (non-secure) random-k at each density, as the accuracy reference; dense SecAgg+ as
Flower ships it (int64 masked values); shared-seed random-k under SecAgg+ at each density, with
and without the shared rotation, packed (modulus-bits per value) and as Flower's int64. Every
federation runs in process on the real ClientApp (fedcomp.run.inprocess_grid.InProcessGrid) with
Flower's DefaultWorkflow + SecAggPlusWorkflow, default CNN on sklearn digits, 10 clients,
Dirichlet 0.5. Bytes are those of the masked vectors in the real replies (``upload-bytes``);
``secagg-protocol-bytes`` (keys, encrypted shares, unmasking shares) are listed apart.
Packing is lossless, so an int64 row trains exactly like its packed row: int64 rows run
``--bytes-rounds`` rounds for their bytes only.

Run: ``python benchmarks/secagg.py [--rounds 50] [--seeds 42] [--densities 0.0625 0.015625]``;
``--sweep D,BITS,C[,LR] ...`` runs only packed + rotated random-k rows at density D with
``secagg-quantization-bits = BITS``, ``secagg-clipping-range = C`` and ``secagg-server-lr = LR``
(default 1; modulus auto: the fewest bits that hold the sum), each labelled with its settings, for
the bits-per-parameter sweep (``--with-fp32`` adds the plain fp32 reference row; ``--alone`` adds
the row of ``secagg = true`` and nothing else, whatever it resolves to)
(``--quick``: 2 rounds, 4 clients, one density; writes to a temporary file unless ``--out``,
see ``benchmarks/outputs.py``).
Prints a table and writes ``benchmarks/results/secagg.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import statistics
import sys
import tempfile
import time

import torch
from flwr.app import Context, RecordDict

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from federated import run_one
from outputs import output_path, shown

from fedcomp.app.client_app import app as client_app
from fedcomp.app.config import AppConfig
from fedcomp.app.secagg_server_app import run_secagg
from fedcomp.run.inprocess_grid import InProcessGrid

N_PARAMS = 38282


def run_secure(run_config: dict, nodes: int) -> list[dict]:
    """One SecAgg+ federation in process; returns the per-round records of ``metrics.json``."""
    cfg = AppConfig.from_run_config(run_config)
    grid = InProcessGrid(client_app, nodes, run_config)
    ctx = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=dict(run_config))
    with tempfile.TemporaryDirectory() as tmp:
        return run_secagg(grid, ctx, cfg, pathlib.Path(tmp))


def summarize(label: str, rounds_by_seed: list[list[dict]], secure: bool) -> dict:
    """Final accuracy (median over seeds), best accuracy, bits/parameter/client and MB per round."""
    finals = [r[-1]["accuracy"] for r in rounds_by_seed]
    trained = [x for r in rounds_by_seed for x in r if x["round"] > 0]
    up = statistics.median(x["upload-bytes"] for x in trained)
    replies = statistics.median(x["num-replies"] for x in trained)
    out = {"label": label, "secure": secure, "final-accuracy": statistics.median(finals), "finals": finals,
           "accuracy-every-10-rounds": [[x["accuracy"] for x in r if x["round"] % 10 == 0] for r in rounds_by_seed],
           "best-accuracy": statistics.median(max(x["accuracy"] for x in r) for r in rounds_by_seed),
           "rounds": rounds_by_seed[0][-1]["round"], "upload-bytes-per-round": up,
           "bits-per-parameter": 8 * up / (replies * N_PARAMS)}
    if secure:
        out["secagg-protocol-bytes-per-round"] = statistics.median(x["secagg-protocol-bytes"] for x in trained)
        out["modulus-bits"] = trained[0]["modulus-bits"]
        out["clipped-entries-per-round"] = statistics.median(x["clipped"] for x in trained)  # at +-c, by clients
    return out


def _sweep_spec(spec: str) -> tuple[float, int, float, float]:
    """``"0.0625,8,0.05"`` -> (density, quantization bits, clipping range, server lr 1.0); a density may be
    ``1/16``; a fourth field is ``secagg-server-lr``."""
    try:
        d, bits, c, *lr = spec.split(",")
        if len(lr) > 1:
            raise ValueError(spec)
        num, _, den = d.partition("/")
        return float(num) / (float(den) if den else 1.0), int(bits), float(c), float(lr[0]) if lr else 1.0
    except ValueError:
        raise SystemExit(f"--sweep {spec!r}: expected DENSITY,BITS,CLIPPING-RANGE[,SERVER-LR], e.g. 1/16,8,0.05 "
                         "or 1/16,3,0.05,4") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--nodes", type=int, default=10)
    ap.add_argument("--seeds", type=int, nargs="+", default=[42])
    ap.add_argument("--densities", type=float, nargs="+", default=[0.0625, 0.015625])
    ap.add_argument("--bytes-rounds", type=int, default=1, help="rounds of the int64 rows (bytes only)")
    ap.add_argument("--skip-dense", action="store_true", help="only the random-k rows (densities, seeds)")
    ap.add_argument("--sweep", nargs="+", default=None, metavar="D,BITS,C",
                    help="only rotated packed random-k rows: density, quantization bits, clipping range")
    ap.add_argument("--with-fp32", action="store_true", help="with --sweep: the plain fp32 FedAvg row too")
    ap.add_argument("--alone", action="store_true",
                    help="the row of secagg = true and nothing else (alone or with --sweep)")
    ap.add_argument("--quick", action="store_true", help="2 rounds, 4 clients, one density (smoke test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.nodes, args.densities, args.seeds = 2, 4, args.densities[:1], args.seeds[:1]
    out = output_path("secagg", args.out, args.quick)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    torch.set_num_threads(1)  # clients train one after another; one thread is fastest on a shared machine
    base = {"num-server-rounds": args.rounds, "lr": 0.1, "secagg-shares": 1.0, "secagg-threshold": 0.7}
    rows, t0 = [], time.perf_counter()

    def go(label, secure, extra, rounds=None):
        runs = []
        for seed in args.seeds:
            rc = {**base, **extra, "seed": seed, **({"num-server-rounds": rounds} if rounds else {})}
            runs.append(run_secure(rc, args.nodes) if secure else run_one(rc, args.nodes))
        row = summarize(label, runs, secure)
        rows.append(row)
        print(f"{label:<44} {row['bits-per-parameter']:>8.3f} {row['final-accuracy']:>8.4f}"
              f"  ({time.perf_counter() - t0:.0f} s)", flush=True)

    print(f"{'configuration':<44} {'bits/p':>8} {'final acc':>8}  ({args.nodes} clients, {args.rounds} rounds, "
          f"seeds {args.seeds})")
    sweeping = bool(args.sweep or args.alone)
    if sweeping:
        if args.with_fp32:
            go("plain FedAvg fp32 (no SecAgg, no compression)", False, {"compressor": "none"})
        if args.alone:
            go("SecAgg+ secagg = true alone", True, {"secagg": True})
        for spec in args.sweep or []:
            d, bits, c, lr = _sweep_spec(spec)
            go(f"SecAgg+ randomk d={d:g}, {bits}-bit, c={c:g}, packed + rotation"
               + ("" if lr == 1 else f", server-lr {lr:g}"), True,
               {"secagg": True, "compressor": "randomk", "density": d, "secagg-rotation": True,
                "secagg-quantization-bits": bits, "secagg-clipping-range": c, "secagg-server-lr": lr})
            rows[-1].update({"density": d, "quantization-bits": bits, "clipping-range": c, "server-lr": lr})
    if not args.skip_dense and not sweeping:
        go("SecAgg+ dense, Flower int64 (today)", True, {"secagg": True, "compressor": "none", "secagg-pack": False},
           rounds=args.bytes_rounds)
        go("plain FedAvg fp32 (no SecAgg, no compression)", False, {"compressor": "none"})
        go("SecAgg+ dense, packed", True, {"secagg": True, "compressor": "none"})
    for d in [] if sweeping else args.densities:
        rk = {"compressor": "randomk", "density": d}
        go(f"plain randomk d={d:g} (no SecAgg)", False, rk)
        go(f"SecAgg+ randomk d={d:g}, int64", True, {"secagg": True, **rk, "secagg-pack": False},
           rounds=args.bytes_rounds)
        go(f"SecAgg+ randomk d={d:g}, packed", True, {"secagg": True, **rk})
        go(f"SecAgg+ randomk d={d:g}, packed + rotation", True, {"secagg": True, **rk, "secagg-rotation": True})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"nodes": args.nodes, "rounds": args.rounds, "seeds": args.seeds,
                               "note": "int64 rows ran --bytes-rounds rounds: their accuracy column is not comparable; "
                                       "packing is lossless, so they train as their packed row",
                               "rows": rows}, indent=1))
    print(f"wrote {shown(out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
