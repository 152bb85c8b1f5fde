"""Federated benchmark: accuracy per uploaded byte for each codec on the default digits data.

Drives the real ClientApp (with ``compression_mod``) and ``CompressedStrategy`` through
``fedcomp.run.inprocess_grid.InProcessGrid`` (no Ray, same code as ``flwr run``).

Run: ``python benchmarks/federated.py [--rounds 50] [--seeds 42 43] [--quick]``.
Prints a table, writes ``benchmarks/results/federated.json`` and draws ``docs/accuracy_vs_bytes.png``
(``--quick``: both in the temporary folder, see ``outputs.py``; ``--plot-only FILE`` redraws both).
``--suite accuracy`` runs the accuracy-per-byte rows instead (BatchNorm ResNet, 12 rounds; CNN at density
1/1000, 50 rounds; seeds 42-44): ``benchmarks/results/federated-accuracy.json`` and
``docs/accuracy_batchnorm.png``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import logging
import pathlib
import statistics
import time

import torch
from flwr.app import ArrayRecord, ConfigRecord
from outputs import REPO, output_path, shown

from fedcomp.app.client_app import app as client_app
from fedcomp.task.training import evaluate
from fedcomp.app.config import AppConfig
from fedcomp.task.data import DataConfig, load_test_set
from fedcomp.task.models import build_model
from fedcomp.app.server_app import build_inner, concern_options
from fedcomp.run.inprocess_grid import InProcessGrid
from fedcomp.strategies import CompressedStrategy
from fedcomp.strategies.round_metrics import client_seconds

CASES = {
    "none": {"compressor": "none"},
    "fp16": {"compressor": "fp16"},
    "int8": {"compressor": "int8"},
    "qsgd": {"compressor": "qsgd"},
    "sign+EF": {"compressor": "sign"},
    "sign": {"compressor": "sign", "error-feedback": False},
    "topk 0.01+EF": {"compressor": "topk", "density": 0.01},
    "topk 0.01": {"compressor": "topk", "density": 0.01, "error-feedback": False},
    "stc 0.01+EF": {"compressor": "stc", "density": 0.01},
    "stc 0.01": {"compressor": "stc", "density": 0.01, "error-feedback": False},
    "stc 0.0025+EF": {"compressor": "stc", "density": 0.0025},
    "stc 0.0025": {"compressor": "stc", "density": 0.0025, "error-feedback": False},
    # remedies for stc at 1/400, one at a time and together
    "stc 0.0025+EF sched": {"compressor": "stc", "density": 0.0025, "density-schedule": "exponential",
                            "density-start": 0.25, "schedule-rounds": 10},
    "stc 0.0025+EF warm": {"compressor": "stc", "density": 0.0025, "warmup-rounds": 2, "warmup-compressor": "int8",
                           "density-schedule": "exponential", "density-start": 0.25, "schedule-rounds": 10},
    "stc 0.0025+EF avgm": {"compressor": "stc", "density": 0.0025, "strategy": "fedavgm", "server-lr": 1.0,
                           "server-momentum": 0.5},
    "stc 0.0025+EF sched+avgm": {"compressor": "stc", "density": 0.0025, "density-schedule": "exponential",
                                 "density-start": 0.25, "schedule-rounds": 10, "strategy": "fedavgm",
                                 "server-lr": 1.0, "server-momentum": 0.5},
    "stc 0.0025+EF sched5+avgm": {"compressor": "stc", "density": 0.0025, "density-schedule": "exponential",
                                  "density-start": 0.05, "schedule-rounds": 5, "strategy": "fedavgm",
                                  "server-lr": 1.0, "server-momentum": 0.5},
    "stc 0.0025+EF tensor": {"compressor": "stc", "density": 0.0025, "selection": "tensor"},
    "sign+EF model-scale": {"compressor": "sign", "selection": "model"},
    "stc 0.01+EF down-stc": {"compressor": "stc", "density": 0.01, "downstream": "stc"},
    "stc 0.01+EF down-fp16": {"compressor": "stc", "density": 0.01, "downstream": "fp16"},
    # rotated 1-bit, low rank, NUQSGD, DGC's momentum correction + local clipping (+ warm-up)
    "eden+EF": {"compressor": "eden"},
    "powersgd r4+EF": {"compressor": "powersgd", "rank": 4},
    "powersgd r1+EF": {"compressor": "powersgd", "rank": 1},
    "qsgd s7": {"compressor": "qsgd", "levels": 7, "error-feedback": False},
    "qsgd s7 exp": {"compressor": "qsgd", "levels": 7, "spacing": "exponential"},
    "stc 0.0025+EF mc": {"compressor": "stc", "density": 0.0025, "momentum-correction": 0.5},
    "stc 0.0025+EF mc0.9": {"compressor": "stc", "density": 0.0025, "momentum-correction": 0.9},
    "stc 0.0025+EF mc+clip": {"compressor": "stc", "density": 0.0025, "momentum-correction": 0.5,
                              "local-clip-norm": 2.0},
    "stc 0.0025+EF dgc": {"compressor": "stc", "density": 0.0025, "momentum-correction": 0.5, "local-clip-norm": 2.0,
                          "density-schedule": "exponential", "density-start": 0.25, "schedule-rounds": 10},
}
BASE_CASES = list(CASES)[:12]
#: remedies, scope and downstream rows: run on the first partitioner only
EXTRA_CASES = list(CASES)[12:]
#: accuracy per byte where it is hard: the BatchNorm ResNet (12 rounds) with the defaults
#: and with BatchNorm's affine parameters sent dense ("bn-affine": batchnorm-affine = "small"), and
#: the CNN at density 1/1000 (50 rounds): "default" = the "auto" defaults (fedcomp.config.low_density: the
#: density warm-up from 25 % over 30 rounds and server momentum below 1/400), "plain" = density-schedule "constant" and
#: FedAvg (no warm-up, no server momentum), and the settings tried: DGC's momentum correction ("mc"), server
#: momentum (FedAvgM, server lr 1.0, momentum 0.5: "avgm"), exponential density schedules from 25 %
#: over 10/20/30 rounds ("schedN"), EF21. ``--suite accuracy`` runs these (not part of the default run).
_PLAIN = {"density-schedule": "constant", "strategy": "fedavg"}
_AVGM = {"strategy": "fedavgm", "server-lr": 1.0, "server-momentum": 0.5}
_STC1000 = {"compressor": "stc", "density": 0.001}


def _sched(rounds: int) -> dict:
    return {"density-schedule": "exponential", "density-start": 0.25, "schedule-rounds": rounds}


ACCURACY_CASES = {
    "resnet none": {"model": "resnet", "compressor": "none", "num-server-rounds": 12},
    "resnet sign+EF": {"model": "resnet", "compressor": "sign", "num-server-rounds": 12},
    "resnet stc 0.01+EF": {"model": "resnet", "compressor": "stc", "density": 0.01, "num-server-rounds": 12},
    "resnet stc 0.01+EF bn-affine": {"model": "resnet", "compressor": "stc", "density": 0.01,
                                     "batchnorm-affine": "small", "num-server-rounds": 12},
    "resnet stc 0.0025+EF": {"model": "resnet", "compressor": "stc", "density": 0.0025, "num-server-rounds": 12},
    "resnet stc 0.0025+EF bn-affine": {"model": "resnet", "compressor": "stc", "density": 0.0025,
                                       "batchnorm-affine": "small", "num-server-rounds": 12},
    "cnn none": {"compressor": "none"},
    "cnn stc 0.001+EF default": dict(_STC1000),
    "cnn stc 0.001+EF plain": {**_STC1000, **_PLAIN},
    "cnn stc 0.001+EF mc": {**_STC1000, **_PLAIN, "momentum-correction": 0.5},
    "cnn stc 0.001+EF mc+avgm": {**_STC1000, **_PLAIN, "momentum-correction": 0.5, **_AVGM},
    "cnn stc 0.001+EF sched10+avgm": {**_STC1000, **_sched(10), **_AVGM},
    "cnn stc 0.001+EF sched20+avgm": {**_STC1000, **_sched(20), **_AVGM},
    "cnn stc 0.001+EF sched20+avgm0.7": {**_STC1000, **_sched(20), **_AVGM, "server-momentum": 0.7},
    "cnn stc 0.001+EF sched30": {**_STC1000, **_sched(30), "strategy": "fedavg"},
    "cnn stc 0.001+EF sched10": {**_STC1000, **_sched(10), "strategy": "fedavg"},
    "cnn stc 0.001+EF21 sched10": {**_STC1000, **_sched(10), "error-feedback": "ef21", "strategy": "fedavg"},
}
CASES.update(ACCURACY_CASES)


def run_one(run_config: dict, num_nodes: int) -> list[dict]:
    """One federation; returns per-round records (round, accuracy, upload bytes, ...)."""
    cfg = AppConfig.from_run_config(run_config)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)  # Flower samples the evaluating nodes with random; they move on with the download
    grid = InProcessGrid(client_app, num_nodes, run_config)
    strategy = CompressedStrategy.from_codec_config(build_inner(cfg), cfg.codec, **concern_options(cfg))
    test = load_test_set(DataConfig(cfg.dataset, cfg.partitioner, cfg.dirichlet_alpha, cfg.seed))
    model = build_model(cfg.model)
    rounds: list[dict] = []

    def evaluate_fn(rnd: int, arrays: ArrayRecord):
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = evaluate(model, test, torch.device("cpu"))
        rounds.append({"round": rnd, "accuracy": acc, "loss": loss, **strategy.history.get(rnd, {}),
                       "clients": strategy.client_history.get(rnd, [])})
        return None

    strategy.start(grid=grid, initial_arrays=ArrayRecord(build_model(cfg.model).state_dict()),
                   num_rounds=cfg.num_server_rounds, train_config=ConfigRecord({"seed": cfg.seed}),
                   evaluate_fn=evaluate_fn)
    return rounds


LINKS_MBPS = (1.0, 10.0, 100.0)
#: The docs' figure, drawn from the reference results ``benchmarks/results/federated.json``.
REFERENCE_FIGURE = REPO / "docs" / "accuracy_vs_bytes.png"
#: Results name per ``--suite``, and the docs' figure of each suite's reference results.
SUITE_NAMES = {"codecs": "federated", "accuracy": "federated-accuracy"}
REFERENCE_FIGURES = {"federated": REFERENCE_FIGURE, "federated-accuracy": REPO / "docs" / "accuracy_batchnorm.png"}


def figure_path(figure: str, results_json: pathlib.Path) -> pathlib.Path:
    """``--figure`` if given; the docs' figure for the reference results; else ``<json>.png``
    beside the results (a quick run never redraws the committed figure)."""
    if figure:
        return pathlib.Path(figure)
    for name, ref in REFERENCE_FIGURES.items():
        if results_json.resolve() == output_path(name, None, quick=False).resolve():
            return ref
    return results_json.with_suffix(".png")


def time_to_accuracy(rounds: list[dict], acc: float, uplink_mbps: float) -> float | None:
    """Simulated seconds until test accuracy >= ``acc``: per round the slowest client's compute +
    upload at ``uplink_mbps`` + download at 10x that (an asymmetric edge link)."""
    total = 0.0
    for r in rounds:
        if r["round"] == 0:
            continue
        total += max((client_seconds(c, uplink_mbps, 10 * uplink_mbps) for c in r["clients"]), default=0.0)
        if r["accuracy"] >= acc:
            return total
    return None


def overhead_fraction(rounds: list[dict]) -> float:
    """(client compression + server decoding time) / local training time, over all rounds."""
    comp = sum(c["compress-seconds"] + c["decode-seconds"] for r in rounds for c in r["clients"])
    train = sum(c["train-seconds"] for r in rounds for c in r["clients"])
    return comp / train if train else 0.0


def first_round_reaching(rounds: list[dict], acc: float) -> int | None:
    """First round whose test accuracy is >= ``acc`` (None if never)."""
    return next((r["round"] for r in rounds if r["round"] > 0 and r["accuracy"] >= acc), None)


def markdown(results: list[dict]) -> str:
    """The docs' results table (docs/benchmarks/federated.md) (one row per partition and case)."""
    lines = ["| partition | codec | final acc. (mean) | rounds to 90 % | rounds to 95 % | upload MB | download MB | "
             "bit/param/round | ratio vs fp32 | time to 90 % at 1 / 10 / 100 Mbps |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        t90 = " / ".join(_fmt_s(r["time_to_90_s"][str(mb)]) for mb in LINKS_MBPS)
        lines.append(
            f"| {r['partitioner']} | {r['case']} | {100 * r['final_accuracy']:.1f} % | "
            f"{', '.join('-' if v is None else str(v) for v in r['rounds_to_90'])} | "
            f"{', '.join('-' if v is None else str(v) for v in r['rounds_to_95'])} | {r['upload_mb']:.3f} | "
            f"{r.get('download_mb', 0.0):.2f} | {r['bits_per_param_per_round']:.4f} | {r['compression_ratio']:.0f}x | "
            f"{t90} |")
    return "\n".join(lines)


def _fmt_s(values: list) -> str:
    ok = [v for v in values if v is not None]
    return f"{statistics.fmean(ok):.0f}s" if len(ok) == len(values) else "never"


def plot(results: list[dict], path: pathlib.Path) -> None:
    """Accuracy against cumulative uploaded MB (log x) for every case (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = sorted({r["partitioner"] for r in results})
    fig, axes = plt.subplots(1, len(parts), figsize=(7 * len(parts), 5), squeeze=False)
    colors = list(plt.get_cmap("tab20").colors) + list(plt.get_cmap("tab20b").colors)
    for ax, part in zip(axes[0], parts):
        for i, r in enumerate(x for x in results if x["partitioner"] == part):
            acc = [statistics.fmean(v) for v in zip(*r["curves"])][1:]
            mb = [statistics.fmean(v) for v in zip(*r["cumulative_upload_mb"])][1:]
            ax.plot(mb, acc, label=r["case"], color=colors[i % len(colors)],
                    linestyle="--" if r.get("error-feedback") is False else "-")
        ax.set_xscale("log")
        ax.set_xlabel("cumulative upload, all clients (MB, log scale)")
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0, 1)
        ax.grid(True, alpha=0.3)
        ax.set_title(f"digits, {part} partition")
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_accuracy(results: list[dict], path: pathlib.Path) -> None:
    """The accuracy-per-byte figure: per model, accuracy per round and accuracy against cumulative uploaded MB
    (log x), mean over seeds; the settings tried ("+EF <remedy>") dashed, the defaults solid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r.get("model", "cnn") for r in results}, reverse=True)
    fig, axes = plt.subplots(len(models), 2, figsize=(13, 4.5 * len(models)), squeeze=False)
    for row, model in zip(axes, models):
        rows = [r for r in results if r.get("model", "cnn") == model]
        for i, r in enumerate(rows):
            acc = [statistics.fmean(v) for v in zip(*r["curves"])]
            mb = [statistics.fmean(v) for v in zip(*r["cumulative_upload_mb"])]
            tried = ("+EF " in r["case"] or "+EF21" in r["case"]) and not r["case"].endswith(" default")
            style = {"color": f"C{i}", "linestyle": "--" if tried else "-", "linewidth": 1.2 if tried else 2.0,
                     "label": r["case"]}
            row[0].plot(range(len(acc)), acc, **style)
            row[1].plot(mb[1:], acc[1:], **style)
        row[0].set_xlabel("round")
        row[1].set_xlabel("cumulative upload, all clients (MB, log scale)")
        row[1].set_xscale("log")
        for ax in row:
            ax.set_ylabel("test accuracy")
            ax.set_ylim(0, 1)
            ax.grid(True, alpha=0.3)
            ax.set_title(f"digits, model = {model!r}, Dirichlet 0.5, mean of {len(rows[0]['seeds'])} seeds")
        row[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--seeds", type=int, nargs="+", default=[42, 43])
    ap.add_argument("--nodes", type=int, default=10)
    ap.add_argument("--partitioner", choices=["dirichlet", "iid"], nargs="+", default=["dirichlet"])
    ap.add_argument("--cases", nargs="+", default=None,
                    help=f"subset of {list(CASES)} (default: the first 12 on every partitioner, the rest on the first)")
    ap.add_argument("--merge", nargs="+", default=[], help="merge these results JSONs into --out (no runs)")
    ap.add_argument("--plot-only", default="", help="print the table and redraw the figure from this JSON; no runs")
    ap.add_argument("--set", nargs="*", default=[], help="extra run-config overrides key=value (numbers or strings)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (tiny model: 1 is fastest)")
    ap.add_argument("--suite", choices=["codecs", "accuracy"], default="codecs",
                    help="codecs: the codec table (default); accuracy: the BatchNorm ResNet and density 1/1000 rows "
                         "(writes results/federated-accuracy.json)")
    ap.add_argument("--quick", action="store_true", help="3 rounds, 1 seed, 3 codecs, 4 nodes (CI smoke test)")
    ap.add_argument("--figure", default="", help="PNG of accuracy vs cumulative MB (default: "
                    "docs/accuracy_vs_bytes.png for the reference results, else the JSON's name with .png)")
    ap.add_argument("--out", default=None, help="JSON to write (default: the reference "
                    "benchmarks/results/federated.json; with --quick a file in the temporary folder)")
    args = ap.parse_args()
    if args.suite == "accuracy":
        args.cases = args.cases or list(ACCURACY_CASES)
        args.seeds = args.seeds if args.seeds != [42, 43] else [42, 43, 44]
    if args.quick:
        args.rounds, args.seeds, args.nodes = 3, [42], 4
        args.cases = (["resnet none", "resnet stc 0.01+EF"] if args.suite == "accuracy"
                      else ["none", "sign+EF", "stc 0.01+EF"])
    args.out = str(output_path(SUITE_NAMES[args.suite], args.out, args.quick))
    draw = plot_accuracy if args.suite == "accuracy" else plot
    if args.merge:
        res = [r for f in args.merge for r in json.loads(pathlib.Path(f).read_text())["results"]]
        pathlib.Path(args.out).write_text(json.dumps({"nodes": args.nodes, "results": res}, indent=1))
        args.plot_only = args.out
    if args.plot_only:
        res = json.loads(pathlib.Path(args.plot_only).read_text())["results"]
        print(markdown(res))
        figure = figure_path(args.figure, pathlib.Path(args.plot_only))
        draw(res, figure)
        print(f"wrote {shown(figure)}")
        return
    logging.getLogger("flwr").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    extra = {}
    for kv in args.set:
        k, v = kv.split("=", 1)
        try:
            extra[k] = json.loads(v)
        except json.JSONDecodeError:
            extra[k] = v
    results = []
    for pi, part in enumerate(args.partitioner):
        cases = args.cases or (BASE_CASES + EXTRA_CASES if pi == 0 else BASE_CASES)
        for name in cases:
            runs = []
            t0 = time.perf_counter()
            for seed in args.seeds:
                rc = {"num-server-rounds": args.rounds, "seed": seed, "partitioner": part, **CASES[name], **extra}
                if args.quick:  # a case's own round count does not outlive --quick
                    rc["num-server-rounds"] = args.rounds
                runs.append(run_one(rc, args.nodes))
            rounds = rc["num-server-rounds"]
            secs = (time.perf_counter() - t0) / len(args.seeds)
            final = statistics.fmean(r[-1]["accuracy"] for r in runs)
            up = statistics.fmean(sum(x.get("upload-bytes", 0.0) for x in r) for r in runs)
            dense = statistics.fmean(sum(x.get("dense-bytes", 0.0) for x in r) for r in runs)
            down = statistics.fmean(sum(x.get("download-bytes", 0.0) for x in r) for r in runs)
            n_params = sum(p.numel() for p in build_model(CASES[name].get("model", "cnn")).parameters())
            per_round_clients = rounds * args.nodes
            row = {
                "partitioner": part, "case": name, **CASES[name], "rounds": rounds, "seeds": args.seeds,
                "final_accuracy": final, "final_accuracy_per_seed": [r[-1]["accuracy"] for r in runs],
                "rounds_to_90": [first_round_reaching(r, 0.90) for r in runs],
                "rounds_to_95": [first_round_reaching(r, 0.95) for r in runs],
                "upload_mb": up / 1e6, "download_mb": down / 1e6,
                "bits_per_param_per_round": 8 * up / (n_params * per_round_clients),
                "compression_ratio": dense / up if up else 0.0, "seconds_per_run": secs,
                "time_to_90_s": {str(mb): [time_to_accuracy(r, 0.90, mb) for r in runs] for mb in LINKS_MBPS},
                "overhead_fraction": statistics.fmean(overhead_fraction(r) for r in runs),
                "residual_bytes_per_client": max(x.get("residual-bytes", 0.0) for r in runs for x in r),
                "curves": [[x["accuracy"] for x in r] for r in runs],
                "cumulative_upload_mb": [list(itertools.accumulate(x.get("upload-bytes", 0.0) / 1e6 for x in r))
                                         for r in runs],
            }
            results.append(row)
            print(f"{part:<9} {name:<15} acc {final:.4f}  to90 {row['rounds_to_90']}  to95 {row['rounds_to_95']}  "
                  f"up {row['upload_mb']:9.4f} MB  {row['bits_per_param_per_round']:7.4f} bit/param  "
                  f"ratio {row['compression_ratio']:8.1f}  down {row['download_mb']:8.3f} MB  t90@1/10/100Mbps "
                  f"{[_fmt_s(row['time_to_90_s'][str(mb)]) for mb in LINKS_MBPS]}  "
                  f"overhead {100 * row['overhead_fraction']:.1f}%  {secs:5.1f} s", flush=True)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"nodes": args.nodes, "extra": extra, "results": results}, indent=1))
    print(f"wrote {shown(out)}")
    print(markdown(results))
    figure = figure_path(args.figure, out)
    draw(results, figure)
    print(f"wrote {shown(figure)}")


if __name__ == "__main__":
    main()
