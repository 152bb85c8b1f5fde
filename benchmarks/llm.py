"""LLM benchmark: LEAF's Shakespeare next-character task with a causal Transformer.

Parts (``--part``), each writing its own key of ``benchmarks/results/llm.json`` (the other parts'
results in the file are kept):

- ``full``: full-model federated training of the small Llama-architecture Transformer
  (``model = "transformer"``, 164,160 parameters) on Shakespeare roles (one client per speaking
  role), fp32 against the codecs that suit it; next-character accuracy and loss of the global model
  on the held-out windows every round, upload bytes per round, rounds to a target accuracy, and
  AdamW's beta1 (0.9 against 0.5) under sign and STC.

Drives the real ClientApp (with ``compression_mod``) and ``CompressedStrategy`` through
``fedcomp.run.inprocess_grid.InProcessGrid`` (the code ``flwr run`` runs, without Ray). The texts are fetched
into ``$FEDCOMP_DATA_DIR`` on first use (``fedcomp.task.text_data``).

Run: ``python benchmarks/llm.py --part full [--rounds 20] [--nodes 8] [--cases ...] [--quick]``.
``python benchmarks/llm.py --part lora [...]`` runs the LoRA part, ``benchmarks/llm_lora.py`` (its own
options: LoRA fine-tuning of a base pretrained on the comedies, on tragedy roles, 2 clients per round,
codecs both ways, and the FlowerTune projection), into the key ``"lora"`` of the same file.
``--quick`` (2 rounds, 3 nodes, 2 cases) writes ``<temp dir>/fedcomp-benchmarks/llm-quick.json``, never
the committed results.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from federated import run_one
from outputs import output_path, shown

from fedcomp.task import text_data
from fedcomp.task.models import build_model
from fedcomp.task.text_data import describe_partition, shakespeare_roles

#: Local training of every full-model case: AdamW, one pass over the role's windows per round.
FULL_BASE = {"dataset": "shakespeare", "model": "transformer", "optimizer": "adamw", "lr": 0.003,
             "adam-beta1": 0.9, "batch-size": 16, "local-epochs": 1}
FULL_CASES = {
    "fp32": {"compressor": "none"},
    "fp32 beta1=0.5": {"compressor": "none", "adam-beta1": 0.5},
    "int8": {"compressor": "int8"},
    "sign+EF": {"compressor": "sign"},
    "sign+EF beta1=0.5": {"compressor": "sign", "adam-beta1": 0.5},
    "topk 0.01+EF": {"compressor": "topk", "density": 0.01},
    "stc 0.01+EF": {"compressor": "stc", "density": 0.01},
    "stc 0.01+EF beta1=0.5": {"compressor": "stc", "density": 0.01, "adam-beta1": 0.5},
    # DGC's warm-up: density 0.1 -> 0.01 exponentially over the first 5 rounds
    "stc 0.01+EF sched": {"compressor": "stc", "density": 0.01, "density-schedule": "exponential",
                          "density-start": 0.1, "schedule-rounds": 5},
    "stc 0.03+EF": {"compressor": "stc", "density": 0.03},
    "stc 0.03+EF beta1=0.5": {"compressor": "stc", "density": 0.03, "adam-beta1": 0.5},
    "stc 0.03+EF beta1=0.5 warm-up sign": {"compressor": "stc", "density": 0.03, "adam-beta1": 0.5,
                                           "warmup-rounds": 1, "warmup-compressor": "sign"},
    "stc 0.04+EF beta1=0.5": {"compressor": "stc", "density": 0.04, "adam-beta1": 0.5},
    "stc 0.0025+EF": {"compressor": "stc", "density": 0.0025},
}
#: The cases measured for docs/benchmarks/llm.md (int8 and top-k are defined but were not run: CPU time).
FULL_DEFAULT_CASES = [c for c in FULL_CASES if c not in ("int8", "topk 0.01+EF")]


def first_round_reaching(rounds: list[dict], acc: float) -> int | None:
    """First round whose test accuracy is >= ``acc`` (None if never)."""
    return next((r["round"] for r in rounds if r["round"] > 0 and r["accuracy"] >= acc), None)


def summarise(name: str, case: dict, rounds: list[dict], n_params: int, nodes: int, secs: float) -> dict:
    """One result row: final accuracy/loss (last round and mean of the last 3), bytes, curves."""
    trained = [r for r in rounds if r["round"] > 0]
    up = sum(r.get("upload-bytes", 0.0) for r in trained)
    dense = sum(r.get("dense-bytes", 0.0) for r in trained)
    down = sum(r.get("download-bytes", 0.0) for r in trained)
    return {
        "case": name, **case, "rounds": len(trained), "final_accuracy": rounds[-1]["accuracy"],
        "final_loss": rounds[-1]["loss"], "last3_accuracy": statistics.fmean(r["accuracy"] for r in rounds[-3:]),
        "best_accuracy": max(r["accuracy"] for r in rounds), "upload_mb": up / 1e6, "download_mb": down / 1e6,
        "upload_bytes_per_round": up / max(len(trained), 1), "compression_ratio": dense / up if up else 0.0,
        "bits_per_param_per_round": 8 * up / (n_params * nodes * max(len(trained), 1)), "seconds": secs,
        "accuracy_curve": [r["accuracy"] for r in rounds], "loss_curve": [r["loss"] for r in rounds],
        "upload_bytes_curve": [r.get("upload-bytes", 0.0) for r in rounds],
    }


#: Fixed accuracy levels for "uploaded MB until the global model first reaches it".
LEVELS = (0.30, 0.35)


def mb_to_reach(row: dict, level: float) -> float | None:
    """Cumulative upload MB (all clients) until the round whose accuracy first reaches ``level``."""
    total = 0.0
    for acc, up in zip(row["accuracy_curve"][1:], row["upload_bytes_curve"][1:]):
        total += up / 1e6
        if acc >= level:
            return total
    return None


def add_targets(rows: list[dict]) -> None:
    """Per row: the upload MB until each of :data:`LEVELS`; and against the fp32 run with the same
    ``adam-beta1`` (like for like; else the plain "fp32" row): the gap (points), the rounds to that
    run's final accuracy minus 1 point, and the upload reduction."""
    for r in rows:
        r["upload_mb_to"] = {f"{level:.2f}": mb_to_reach(r, level) for level in LEVELS}
    dense = {r.get("adam-beta1", FULL_BASE["adam-beta1"]): r for r in rows if r.get("compressor") == "none"}
    for r in rows:
        ref = dense.get(r.get("adam-beta1", FULL_BASE["adam-beta1"])) or next(
            (x for x in rows if x["case"] == "fp32"), None)
        if ref is None:
            continue
        curve = [{"round": i, "accuracy": a} for i, a in enumerate(r["accuracy_curve"])]
        r["reference"] = ref["case"]
        r["target_accuracy"] = ref["final_accuracy"] - 0.01
        r["rounds_to_target"] = first_round_reaching(curve, r["target_accuracy"])
        r["points_below_fp32"] = 100 * (ref["final_accuracy"] - r["final_accuracy"])
        r["points_below_fp32_last3"] = 100 * (ref["last3_accuracy"] - r["last3_accuracy"])
        r["upload_reduction_vs_fp32"] = ref["upload_mb"] / r["upload_mb"] if r["upload_mb"] else 0.0


def run_full(args, save=None) -> dict:
    """The full-model part: every case of ``args.cases`` on ``args.nodes`` roles for ``args.rounds``;
    ``save(part)`` is called after every case (a long run keeps what it has measured)."""
    n_params = sum(p.numel() for p in build_model("transformer").parameters())
    setup = {**FULL_BASE, "nodes": args.nodes, "rounds": args.rounds, "seed": args.seed,
             "test-windows": args.test_windows, "parameters": n_params,
             "partition": describe_partition(shakespeare_roles())}
    rows = []
    for name in args.cases:
        rc = {**FULL_BASE, **FULL_CASES[name], "num-server-rounds": args.rounds, "seed": args.seed}
        t0 = time.perf_counter()
        rounds = run_one(rc, args.nodes)
        row = summarise(name, FULL_CASES[name], rounds, n_params, args.nodes, time.perf_counter() - t0)
        rows.append(row)
        print(f"{name:<24} acc {row['final_accuracy']:.4f} (last 3 {row['last3_accuracy']:.4f})  "
              f"loss {row['final_loss']:.3f}  up {row['upload_mb']:8.3f} MB  {row['bits_per_param_per_round']:7.4f} "
              f"bit/param  ratio {row['compression_ratio']:7.1f}  {row['seconds']:6.0f} s", flush=True)
        add_targets(rows)
        if save is not None:
            save({"setup": setup, "results": rows})
    return {"setup": setup, "results": rows}


def markdown_full(part: dict) -> str:
    """The docs' table (docs/benchmarks/llm.md) of the full-model part."""
    levels = " | ".join(f"upload MB to {100 * level:.0f} %" for level in LEVELS)
    lines = [("| codec | next-char acc. (last / mean of last 3) | vs fp32, same beta1 (points) | "
              "rounds to fp32 - 1 pt | "
              f"upload MB | bit/param/round | upload vs fp32 | {levels} |"),
             "|---|---|---|---|---|---|---|" + "---|" * len(LEVELS)]
    for r in part["results"]:
        to = " | ".join("-" if v is None else f"{v:.3g}" for v in r.get("upload_mb_to", {}).values())
        lines.append(
            f"| {r['case']} | {100 * r['final_accuracy']:.1f} % / {100 * r['last3_accuracy']:.1f} % | "
            f"{0.0 - r.get('points_below_fp32', 0.0):+.1f} | {r.get('rounds_to_target') or '-'} | "
            f"{r['upload_mb']:.3f} | {r['bits_per_param_per_round']:.4f} | "
            f"{r.get('upload_reduction_vs_fp32', 0.0):.0f}x | {to} |")
    return "\n".join(lines)


def plot_full(part: dict, path: pathlib.Path) -> None:
    """Next-character accuracy against round and against cumulative upload MB (log x), every case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_round, by_mb) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.get_cmap("tab20").colors
    for i, r in enumerate(part["results"]):
        acc = r["accuracy_curve"]
        mb = [sum(r["upload_bytes_curve"][1:i + 1]) / 1e6 for i in range(1, len(acc))]
        style = "--" if "beta1" in r["case"] else "-"
        by_round.plot(range(len(acc)), acc, style, label=r["case"], color=colors[i % len(colors)])
        by_mb.plot(mb, acc[1:], style, label=r["case"], color=colors[i % len(colors)])
    by_round.set_xlabel("round")
    by_mb.set_xlabel("cumulative upload, all clients (MB, log scale)")
    by_mb.set_xscale("log")
    for ax in (by_round, by_mb):
        ax.set_ylabel("next-character accuracy (held-out windows)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    s = part["setup"]
    fig.suptitle(f"Shakespeare (LEAF roles), {s['parameters']:,}-parameter Transformer, {s['nodes']} clients, AdamW")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


PARTS = {"full": (run_full, markdown_full, FULL_DEFAULT_CASES)}
PLOTS = {"full": plot_full}


def main() -> None:
    if sys.argv[1:3] == ["--part", "lora"]:  # the LoRA part has its own options: benchmarks/llm_lora.py
        import llm_lora

        sys.argv[1:3] = []
        return llm_lora.main()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=sorted(PARTS), default="full")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--nodes", type=int, default=8, help="clients (speaking roles), all sampled every round")
    ap.add_argument("--seed", type=int, default=3, help="run seed; it also picks the roles (3: 29.5k chars)")
    ap.add_argument("--cases", nargs="+", default=None, help=f"subset of {list(FULL_CASES)}")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--test-windows", type=int, default=256, help="held-out 80-character windows scored per round")
    ap.add_argument("--merge", nargs="+", default=[], help="merge this part of these JSONs into --out (no runs)")
    ap.add_argument("--quick", action="store_true", help="2 rounds, 3 nodes, 2 cases (smoke test)")
    ap.add_argument("--table-only", action="store_true", help="print the table from --out; no runs")
    ap.add_argument("--figure", default="", help="also draw the part's curves to this PNG")
    ap.add_argument("--out", default=None, help="JSON to write (default: the reference benchmarks/results/llm.json; "
                    "with --quick a file in the temporary folder)")
    args = ap.parse_args()
    run, table, default_cases = PARTS[args.part]
    if args.quick:
        args.rounds, args.nodes, args.cases = 2, 3, ["fp32", "stc 0.01+EF"]
    args.cases = args.cases or default_cases
    out = output_path("llm", args.out, args.quick)
    data = json.loads(out.read_text()) if out.exists() else {}
    if args.merge:
        parts = [json.loads(pathlib.Path(f).read_text())[args.part] for f in args.merge]
        rows = [r for p in parts for r in p["results"]]
        if args.part == "full":
            rows.sort(key=lambda r: list(FULL_CASES).index(r["case"]) if r["case"] in FULL_CASES else len(FULL_CASES))
        add_targets(rows)
        data[args.part] = {**parts[0], "results": rows}
        out.write_text(json.dumps(data, indent=1))
        args.table_only = True
    if args.table_only:
        if args.figure and args.part in PLOTS:
            PLOTS[args.part](data[args.part], pathlib.Path(args.figure))
        print(table(data[args.part]))
        return
    logging.getLogger("flwr").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    text_data.TEST_WINDOWS = args.test_windows
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(part: dict) -> None:
        data[args.part] = part
        out.write_text(json.dumps(data, indent=1))

    save(run(args, save))
    print(f"wrote {shown(out)}")
    if args.figure and args.part in PLOTS:
        PLOTS[args.part](data[args.part], pathlib.Path(args.figure))
    print(table(data[args.part]))


if __name__ == "__main__":
    main()
