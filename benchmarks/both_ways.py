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

``--model resnet`` / ``--model transformer``: the models where compression is hardest, with their
own cases (:data:`MODEL_CASES`): the BatchNorm ResNet from scratch on digits (8 rounds, 10 clients,
seeds 42-44) and the full-model Transformer on Shakespeare (llm.py's full-model part, AdamW beta1
0.5, 20 rounds, 8 roles, seed 3); results in ``benchmarks/results/both_ways_<model>.json``
(``both_ways_<model>_<N>r.json`` for another round count). Each row also has the median accuracy
of the last three rounds and the bytes both ways until fp32's median final accuracy minus 1 point.
``--merge A.json B.json ...`` joins runs made by one process per case.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import platform
import shlex
import statistics
import sys
import time

import torch

from federated import run_one
from outputs import output_path, shown

from fedcomp.task import text_data

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
    "default, downstream correction on": {"downstream-correction": "on"},
}
QUICK_CASES = ["fp32 both ways", "default upload, dense download", "default (stc 5 % down, seeded start)"]
#: the downstream correction off (the Transformer's levers were measured before it existed)
_OFF = {"downstream-correction": "off"}
#: ``--model``: the models where compression is hardest (BatchNorm ResNet, Transformer), each on its own
#: data and local training, with fp32 both ways, the upload codecs of their upload-only rows with
#: ``downstream = "auto"`` and the levers tried; the default (``cnn``) keeps :data:`CASES` above.
MODEL_BASES = {
    "resnet": {"model": "resnet"},
    # llm.py's full-model part with AdamW's beta1 at 0.5 (its best setting for the compressed uploads)
    "transformer": {"dataset": "shakespeare", "model": "transformer", "optimizer": "adamw", "lr": 0.003,
                    "adam-beta1": 0.5, "batch-size": 16, "local-epochs": 1},
}
MODEL_CASES = {
    "resnet": {
        "fp32 both ways": {"compressor": "none"},
        "sign up, auto down": {"compressor": "sign"},
        "stc 1 % up, auto down": {"compressor": "stc", "density": 0.01},
        "stc 1 % up, dense download": {"compressor": "stc", "density": 0.01, "downstream": "none"},
        "sign up, dense download": {"compressor": "sign", "downstream": "none"},
        "fp32 up, auto's stc 5 % down": {"compressor": "none", "downstream": "stc", "downstream-density": 0.05},
        "stc 1 % up, stc 20 % down": {"compressor": "stc", "density": 0.01, "downstream-density": 0.2},
        "stc 1 % up, stc 2 % down": {"compressor": "stc", "density": 0.01, "downstream-density": 0.02},
        "stc 1 % up, auto down, dense first model": {"compressor": "stc", "density": 0.01, "downstream-init": "dense"},
        "stc 1 % up, auto down, bn-affine": {"compressor": "stc", "density": 0.01, "batchnorm-affine": "small"},
        "stc 1 % up, auto down, ramp": {"compressor": "stc", "density": 0.01, "density-schedule": "exponential",
                                        "density-start": 0.25, "schedule-rounds": 5},
        "stc 1 % up, auto down, avgm": {"compressor": "stc", "density": 0.01, "strategy": "fedavgm",
                                        "server-lr": 1.0, "server-momentum": 0.5},
        "sign up, auto down, avgm": {"compressor": "sign", "strategy": "fedavgm", "server-lr": 1.0,
                                     "server-momentum": 0.5},
    },
    # the levers after the first four rows ran before the downstream correction existed, i.e. with it off
    "transformer": {
        "fp32 both ways": {"compressor": "none"},
        "stc 4 % up, auto down": {"compressor": "stc", "density": 0.04},
        "stc 4 % up, auto down, no correction": {"compressor": "stc", "density": 0.04, **_OFF},
        "stc 4 % up, dense download": {"compressor": "stc", "density": 0.04, "downstream": "none"},
        # each direction alone at the 100x-both-ways budget (2.1 MB both ways here): the other one exact
        "stc 8 % up, dense download": {"compressor": "stc", "density": 0.08, "downstream": "none"},
        "stc 16 % up, dense download": {"compressor": "stc", "density": 0.16, "downstream": "none"},
        "fp32 up, stc 5 % down": {"compressor": "none", "downstream": "stc", "downstream-density": 0.05},
        # with the correction (app default for AdamW): the density split at ~100x both ways
        "stc 6 % up, stc 3 % down": {"compressor": "stc", "density": 0.06, "downstream-density": 0.03},
        "stc 5 % up, stc 4 % down": {"compressor": "stc", "density": 0.05, "downstream-density": 0.04},
        "stc 3 % up, stc 8 % down": {"compressor": "stc", "density": 0.03, "downstream-density": 0.08},
        "stc 4 % up, top-k 1 % down": {"compressor": "stc", "density": 0.04, "downstream": "topk",
                                       "downstream-density": 0.01, **_OFF},
        "randsign 25 % up, auto down": {"compressor": "randsign", "density": 0.25, **_OFF},
        "randsign 25 % up, randsign 25 % down": {"compressor": "randsign", "density": 0.25, "downstream": "randsign",
                                                 "downstream-density": 0.25, **_OFF},
        "stc 4 % up, randsign 30 % down": {"compressor": "stc", "density": 0.04, "downstream": "randsign",
                                           "downstream-density": 0.3, **_OFF},
        "stc 4 % up, auto down, ramp": {"compressor": "stc", "density": 0.04, "density-schedule": "exponential",
                                        "density-start": 0.25, "schedule-rounds": 5, **_OFF},
        "stc 4 % up, auto down, per tensor": {"compressor": "stc", "density": 0.04, "selection": "tensor", **_OFF},
        "stc 4 % up, sign down": {"compressor": "stc", "density": 0.04, "downstream": "sign", **_OFF},
        "stc 2 % up, stc 10 % down": {"compressor": "stc", "density": 0.02, "downstream-density": 0.1, **_OFF},
        "stc 6 % up, stc 3 % down, no correction": {"compressor": "stc", "density": 0.06, "downstream-density": 0.03,
                                                    **_OFF},
        "stc 4 % up, auto down, dense first model": {"compressor": "stc", "density": 0.04, "downstream-init": "dense",
                                                     **_OFF},
        "stc 4 % up, int8 down": {"compressor": "stc", "density": 0.04, "downstream": "int8", **_OFF},
        "stc 4 % up, auto down, avgm": {"compressor": "stc", "density": 0.04, "strategy": "fedavgm", "server-lr": 1.0,
                                        "server-momentum": 0.5, **_OFF},
    },
}
#: rounds and nodes of ``--model`` runs (ResNet: 8 rounds; Transformer: llm.py's full-model part)
MODEL_DEFAULTS = {"cnn": (50, 10), "resnet": (8, 10), "transformer": (20, 8)}


def measure(case: str, run_config: dict, seed: int, rounds: int, nodes: int) -> dict:
    """One federation: final accuracy and the bytes of each direction (first round's download apart)."""
    t0 = time.perf_counter()
    recs = run_one({**run_config, "seed": seed, "num-server-rounds": rounds}, nodes)
    trained = [r for r in recs if r["round"] > 0]
    up = sum(r["upload-bytes"] for r in trained)
    down = sum(r["download-bytes"] for r in trained)
    return {"case": case, "seed": seed, "final_accuracy": recs[-1]["accuracy"], "upload_bytes": up,
            "download_bytes": down, "first_download_bytes": trained[0]["download-bytes"] if trained else 0.0,
            "fp32_one_way_bytes": sum(r["dense-bytes"] for r in trained), "seconds": time.perf_counter() - t0,
            "accuracy_curve": [r["accuracy"] for r in recs],
            "bytes_both_ways_curve": [r.get("upload-bytes", 0.0) + r.get("download-bytes", 0.0) for r in recs]}


def summarize(rows: list[dict]) -> list[dict]:
    """Medians over seeds per case, ratios against the fp32 case's bytes both ways; with curves, the
    bytes both ways until fp32's median final accuracy minus 1 point and their ratio to fp32's."""
    out = []
    fp32 = [r["final_accuracy"] for r in rows if r["case"] == "fp32 both ways"]
    fp32_target = statistics.median(fp32) - 0.01 if fp32 else None
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == case]
        med = {k: statistics.median(r[k] for r in mine) for k in
               ("final_accuracy", "upload_bytes", "download_bytes", "first_download_bytes", "fp32_one_way_bytes")}
        if all("accuracy_curve" in r for r in mine):  # less noisy than the last round on small test sets
            med["last3_accuracy"] = statistics.median(statistics.fmean(r["accuracy_curve"][-3:]) for r in mine)
        total = med["upload_bytes"] + med["download_bytes"]
        if fp32_target is not None and all("accuracy_curve" in r for r in mine):
            reach = [bytes_to(r, fp32_target) for r in mine]
            med["bytes_to_fp32_minus_1pt"] = None if None in reach else statistics.median(reach)
        out.append({"case": case, "seeds": [r["seed"] for r in mine], **med,
                    "accuracies": [r["final_accuracy"] for r in mine],
                    "ratio_both_ways": 2 * med["fp32_one_way_bytes"] / total if total else 0.0,
                    "ratio_upload": med["fp32_one_way_bytes"] / med["upload_bytes"] if med["upload_bytes"] else 0.0})
    if fp32_target is not None:
        ref = next(s.get("bytes_to_fp32_minus_1pt") for s in out if s["case"] == "fp32 both ways")
        for s in out:
            mine = s.get("bytes_to_fp32_minus_1pt")
            s["ratio_to_fp32_minus_1pt"] = ref / mine if ref and mine else None
    return out


def bytes_to(run: dict, accuracy: float) -> float | None:
    """Bytes both ways (first model included) until the test accuracy is >= ``accuracy`` (None: never)."""
    total = 0.0
    for acc, sent in zip(run["accuracy_curve"], run["bytes_both_ways_curve"]):
        total += sent
        if acc >= accuracy and total > 0:
            return total
    return None


def markdown(summary: list[dict]) -> str:
    """The docs' table."""
    fp32 = next((s["final_accuracy"] for s in summary if s["case"] == "fp32 both ways"), None)
    lines = ["| case | final acc. (median) | vs fp32 | upload MB | download MB (first model) | ratio up "
             "| ratio both ways |",
             "|---|---|---|---|---|---|---|"]
    for s in summary:
        gap = "" if fp32 is None else f"{100 * (s['final_accuracy'] - fp32):+.1f}"
        lines.append(f"| {s['case']} | {100 * s['final_accuracy']:.1f} % | {gap} | {s['upload_bytes'] / 1e6:.3f} | "
                     f"{s['download_bytes'] / 1e6:.3f} ({s['first_download_bytes'] / 1e6:.3f}) | "
                     f"{s['ratio_upload']:.0f}x | {s['ratio_both_ways']:.0f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=None,
                    help="default: 42 43 44 (cnn, resnet); 3 (transformer: llm.py's seed, which also picks the roles)")
    ap.add_argument("--model", choices=list(MODEL_DEFAULTS), default="cnn",
                    help="cnn: the default federation; resnet / transformer: MODEL_CASES (own JSON name)")
    ap.add_argument("--rounds", type=int, default=None, help="default: 50 (cnn), 8 (resnet), 20 (transformer)")
    ap.add_argument("--nodes", type=int, default=None, help="default: 10 (cnn, resnet), 8 (transformer)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: 1 with --model resnet/transformer, torch's own for cnn)")
    ap.add_argument("--cases", nargs="+", default=None, help="case names (default: all)")
    ap.add_argument("--merge", nargs="+", default=[], help="merge the runs of these JSONs into --out (no runs)")
    ap.add_argument("--quick", action="store_true", help="3 rounds, 1 seed, 3 cases (smoke test)")
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/both_ways.json; "
                    "with --quick a file in the temporary folder)")
    args = ap.parse_args()
    logging.getLogger("flwr").setLevel(logging.ERROR)
    if args.threads or args.model != "cnn":
        torch.set_num_threads(args.threads or 1)
    table = CASES if args.model == "cnn" else {k: {**MODEL_BASES[args.model], **v}
                                                for k, v in MODEL_CASES[args.model].items()}
    args.seeds = args.seeds or ([3] if args.model == "transformer" else [42, 43, 44])
    text_data.TEST_WINDOWS = 256  # llm.py's held-out windows per evaluation (no effect on the image models)
    args.rounds = args.rounds or MODEL_DEFAULTS[args.model][0]
    args.nodes = args.nodes or MODEL_DEFAULTS[args.model][1]
    cases = args.cases or list(table)
    if args.quick:
        args.rounds, args.seeds = 3, args.seeds[:1]
        cases = QUICK_CASES if args.model == "cnn" else list(table)[:2]
    unknown = [c for c in cases if c not in table]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; known: {list(table)}")
    name = "both_ways" if args.model == "cnn" else f"both_ways_{args.model}"
    if args.model != "cnn" and args.rounds != MODEL_DEFAULTS[args.model][0] and not args.quick:
        name += f"_{args.rounds}r"  # e.g. both_ways_resnet_30r.json: the bytes-to-accuracy run
    path = output_path(name, args.out, args.quick)
    path.parent.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "benchmarks/both_ways.py", *sys.argv[1:]])

    def save(rows: list[dict], commands: list[str]) -> None:
        path.write_text(json.dumps({"model": args.model, "commands": commands,
                                    "cases": {c: table[c] for c in dict.fromkeys(r["case"] for r in rows)},
                                    "rounds": args.rounds, "nodes": args.nodes, "seeds": args.seeds,
                                    "machine": f"{platform.machine()}, Python {platform.python_version()}",
                                    "date": time.strftime("%Y-%m-%d"), "summary": summarize(rows), "runs": rows},
                                   indent=1))

    if args.merge:  # runs made by several processes (one per case) into one file
        parts = [json.loads(pathlib.Path(f).read_text()) for f in args.merge]
        rows = [r for p in parts for r in p["runs"]]
        save(rows, [c for p in parts for c in p.get("commands", [p.get("command")])] + [command])
        print(markdown(summarize(rows)))
        print(f"wrote {shown(path)}")
        return
    rows: list[dict] = []
    for case in cases:
        for seed in args.seeds:
            rows.append(measure(case, table[case], seed, args.rounds, args.nodes))
            r = rows[-1]
            print(f"{case} seed {seed}: {100 * r['final_accuracy']:.1f} %, up {r['upload_bytes'] / 1e6:.3f} MB, "
                  f"down {r['download_bytes'] / 1e6:.3f} MB ({r['seconds']:.0f} s)", flush=True)
            save(rows, [command])  # after every run: a run stopped halfway keeps what it measured
    print(markdown(summarize(rows)))
    print(f"wrote {shown(path)}")


if __name__ == "__main__":
    main()
