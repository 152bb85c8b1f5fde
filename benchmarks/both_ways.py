"""Bytes both ways: what the default federation sends and receives, against fp32 both ways.

Drives the real ClientApp (``compression_mod``) and ``CompressedStrategy`` through the in-process
grid (``benchmarks/federated.py``'s ``run_one``: no Ray, the code ``flwr run`` runs) on the default
federation (digits, CNN, 10 clients, every client every round, 50 rounds), for several seeds, and
counts every byte that travels: uploads, the first model each client gets (a seeded start, a
compressed start or the dense model) and every broadcast after it. The fp32 baseline is
``compressor = "none"`` both ways; "ratio both ways" = its bytes both ways / the case's.

Run: ``python benchmarks/both_ways.py [--seeds 42 43 44] [--rounds 50] [--quick]``; prints a table
(medians over seeds) and writes ``benchmarks/results/both_ways.json`` (``--quick``: 3 rounds, one
seed, three cases, into the temporary folder, see ``outputs.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time

from federated import run_one
from outputs import output_path, shown

#: case -> run config on top of the defaults (which are the "default" case itself)
CASES = {
    "fp32 both ways": {"compressor": "none"},
    "default upload, dense download": {"downstream": "none"},
    "default upload, dense first model": {"downstream-init": "dense"},
    "default (stc 5 % down, seeded start)": {},
    "stc 3 % down": {"downstream-density": 0.03},
    "stc 2 % down": {"downstream-density": 0.02},
    "stc 1 % down": {"downstream-density": 0.01},
    "stc 10 % down": {"downstream-density": 0.1},
    "sign down": {"downstream": "sign"},
    "int8 start, stc 5 % down": {"downstream-init": "int8"},
}
QUICK_CASES = ["fp32 both ways", "default upload, dense download", "default (stc 5 % down, seeded start)"]


def measure(case: str, run_config: dict, seed: int, rounds: int, nodes: int) -> dict:
    """One federation: final accuracy and the bytes of each direction (first round's download apart)."""
    t0 = time.perf_counter()
    recs = run_one({**run_config, "seed": seed, "num-server-rounds": rounds}, nodes)
    trained = [r for r in recs if r["round"] > 0]
    up = sum(r["upload-bytes"] for r in trained)
    down = sum(r["download-bytes"] for r in trained)
    return {"case": case, "seed": seed, "final_accuracy": recs[-1]["accuracy"], "upload_bytes": up,
            "download_bytes": down, "first_download_bytes": trained[0]["download-bytes"] if trained else 0.0,
            "fp32_one_way_bytes": sum(r["dense-bytes"] for r in trained), "seconds": time.perf_counter() - t0}


def summarize(rows: list[dict]) -> list[dict]:
    """Medians over seeds per case, ratios against the fp32 case's bytes both ways."""
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == case]
        med = {k: statistics.median(r[k] for r in mine) for k in
               ("final_accuracy", "upload_bytes", "download_bytes", "first_download_bytes", "fp32_one_way_bytes")}
        total = med["upload_bytes"] + med["download_bytes"]
        out.append({"case": case, "seeds": [r["seed"] for r in mine], **med,
                    "accuracies": [r["final_accuracy"] for r in mine],
                    "ratio_both_ways": 2 * med["fp32_one_way_bytes"] / total if total else 0.0,
                    "ratio_upload": med["fp32_one_way_bytes"] / med["upload_bytes"] if med["upload_bytes"] else 0.0})
    return out


def markdown(summary: list[dict]) -> str:
    """The docs' table."""
    fp32 = next((s["final_accuracy"] for s in summary if s["case"] == "fp32 both ways"), None)
    lines = ["| case | final acc. (median) | vs fp32 | upload MB | download MB (first model) | ratio up | ratio both ways |",
             "|---|---|---|---|---|---|---|"]
    for s in summary:
        gap = "" if fp32 is None else f"{100 * (s['final_accuracy'] - fp32):+.1f}"
        lines.append(f"| {s['case']} | {100 * s['final_accuracy']:.1f} % | {gap} | {s['upload_bytes'] / 1e6:.3f} | "
                     f"{s['download_bytes'] / 1e6:.3f} ({s['first_download_bytes'] / 1e6:.3f}) | "
                     f"{s['ratio_upload']:.0f}x | {s['ratio_both_ways']:.0f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--nodes", type=int, default=10)
    ap.add_argument("--cases", nargs="+", default=None, help="case names (default: all)")
    ap.add_argument("--quick", action="store_true", help="3 rounds, 1 seed, 3 cases (smoke test)")
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/both_ways.json; "
                    "with --quick a file in the temporary folder)")
    args = ap.parse_args()
    logging.getLogger("flwr").setLevel(logging.ERROR)
    cases = args.cases or list(CASES)
    if args.quick:
        args.rounds, args.seeds, cases = 3, args.seeds[:1], QUICK_CASES
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; known: {list(CASES)}")
    path = output_path("both_ways", args.out, args.quick)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for case in cases:
        for seed in args.seeds:
            rows.append(measure(case, CASES[case], seed, args.rounds, args.nodes))
            r = rows[-1]
            print(f"{case} seed {seed}: {100 * r['final_accuracy']:.1f} %, up {r['upload_bytes'] / 1e6:.3f} MB, "
                  f"down {r['download_bytes'] / 1e6:.3f} MB ({r['seconds']:.0f} s)", flush=True)
            # rewritten after every run: a run stopped halfway keeps what it measured
            path.write_text(json.dumps({"rounds": args.rounds, "nodes": args.nodes, "seeds": args.seeds,
                                        "machine": f"{platform.machine()}, Python {platform.python_version()}",
                                        "date": time.strftime("%Y-%m-%d"), "summary": summarize(rows), "runs": rows},
                                       indent=1))
    print(markdown(summarize(rows)))
    print(f"wrote {shown(path)}")


if __name__ == "__main__":
    main()
