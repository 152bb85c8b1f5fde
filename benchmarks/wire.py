"""Bytes on the wire: every message's serialised content, both ways, evaluation included.

Counts what Flower sends (``recorddict_to_proto(message.content).ByteSize()`` of every message the
ServerApp sends and every reply it receives, train and evaluate) with a Grid of its own that weighs
each message it carries, independently of fedcomp's counters, and compares the two. Two federations,
each with its fp32 counterpart in the same run:

- ``reference``: the reference app as the README runs it (digits, CNN, 10 SuperNodes, federated
  evaluation on half of them every round, 50 rounds), its default codecs against ``compressor = "none"``;
- ``existing-app``: ``examples/existing-app`` (an ordinary Flower app, an MLP on digits, 10 clients,
  every client evaluates every round) with the README's two lines (``compressor="sign"``, and the
  library's default codec; the library's default download) and with other downloads, against the
  same app without them (plain FedAvg).

Run: ``python benchmarks/wire.py [--seeds 42 43 44] [--rounds 50] [--quick]``; prints a table
(medians over seeds) and writes ``benchmarks/results/wire.json`` (``--quick``: 3 rounds, one seed,
into the temporary folder, see ``outputs.py``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import statistics
import sys
import tempfile

from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.common.serde import recorddict_to_proto
from flwr.serverapp.strategy import FedAvg
from outputs import output_path, shown

from fedcomp.app.client_app import app as reference_client_app
from fedcomp.app.server_app import main as reference_main
from fedcomp.run.inprocess_grid import InProcessGrid
from fedcomp.strategies import CompressedStrategy, Download

REPO = pathlib.Path(__file__).resolve().parents[1]


class WeighingGrid(InProcessGrid):
    """An in-process Grid that adds up the serialised content of every message it carries."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.down = self.up = 0

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        self.down += sum(recorddict_to_proto(m.content).ByteSize() for m in messages)
        replies = list(super().send_and_receive(messages, timeout=timeout))
        self.up += sum(recorddict_to_proto(r.content).ByteSize() for r in replies if not r.has_error())
        return replies


def reference(seed: int, rounds: int, compressor: str | None) -> dict:
    """The reference app in process; ``compressor``: None for its defaults, "none" for fp32."""
    with tempfile.TemporaryDirectory() as out:
        rc = {"results-dir": out, "seed": seed, "num-server-rounds": rounds}
        if compressor is not None:
            rc["compressor"] = compressor
        grid = WeighingGrid(reference_client_app, 10, rc)
        reference_main(grid, Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=rc))
        last = json.loads((pathlib.Path(out) / "metrics.json").read_text())["rounds"][-1]
    return {"accuracy": last["accuracy"], "counted-mb": (grid.down + grid.up) / 1e6,
            "reported-mb": last["cumulative-mb"], "reported-ratio": last["cumulative-ratio-both-ways"]}


def existing_app(seed: int, rounds: int, lines: dict | None) -> dict:
    """``examples/existing-app`` in process; ``lines``: CompressedStrategy's arguments (None: plain FedAvg)."""
    sys.path.insert(0, str(REPO / "examples" / "existing-app"))
    client = importlib.import_module("existingapp.client_app")
    task = importlib.import_module("existingapp.task")
    import torch

    torch.manual_seed(seed)
    rc = {"num-server-rounds": rounds, "fraction-train": 1.0, "fraction-evaluate": 1.0, "min-nodes": 10,
          "local-epochs": 1, "lr": 0.05, "results-file": ""}
    fedavg = FedAvg(fraction_train=1.0, fraction_evaluate=1.0, min_train_nodes=10, min_evaluate_nodes=10,
                    min_available_nodes=10)
    strategy = fedavg if lines is None else CompressedStrategy(fedavg, **lines)
    app = client.app if lines is not None else _plain_client(client)
    grid = WeighingGrid(app, 10, rc)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(task.Net().state_dict()), num_rounds=rounds,
                            train_config=ConfigRecord({"lr": 0.05}))
    acc = result.evaluate_metrics_clientapp[rounds]["eval-acc"]
    out = {"accuracy": float(acc), "counted-mb": (grid.down + grid.up) / 1e6}
    if lines is not None:
        h = strategy.history
        out["reported-mb"] = sum(h[r]["wire-bytes-down"] + h[r]["wire-bytes-up"] for r in h) / 1e6
    return out


def _plain_client(client_module):
    """The example's ClientApp without ``compression_mod`` (what the app was before the two lines)."""
    from flwr.clientapp import ClientApp

    plain = ClientApp()
    plain.train()(client_module.train_fn)
    plain.evaluate()(client_module.evaluate_fn)
    return plain


CASES = {
    "reference: fp32 both ways": ("reference", "none"),
    "reference: defaults": ("reference", None),
    "existing app: plain FedAvg": ("existing", None),
    "existing app + two lines, sign": ("existing", {"compressor": "sign"}),
    "existing app + two lines, default codec": ("existing", {}),
    "existing app, sign, sign download": ("existing", {"compressor": "sign", "downstream": "sign"}),
    "existing app, sign, STC 0.05 download": ("existing", {"compressor": "sign",
                                                          "downstream": Download("stc", density=0.05)}),
    "existing app, sign, dense download": ("existing", {"compressor": "sign", "downstream": "none"}),
}


def table(rows: list[dict], seeds: list[int]) -> dict:
    """The page's table (``docs/hooks/generate.py`` renders it): one row per case, medians over seeds."""
    out = []
    for r in rows:
        n = len(seeds) if r["case"] in MAIN_CASES else 1
        out.append([r["case"], f"{100 * r['accuracy']:.1f} %", f"{100 * r['accuracy-vs-fp32']:+.1f}",
                    f"{r['mb']:.3f}", f"**{r['ratio']:.1f}x**", f"{r['reported-over-counted']:.4f}", str(n)])
    return {"columns": ["case", "final accuracy", "points vs its fp32", "MB on the wire, both ways",
                        "fewer bytes than fp32", "fedcomp's count / outside count", "seeds"], "rows": out}


#: The cases run on every seed; the other downloads run on the first seed only.
MAIN_CASES = list(CASES)[:5]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--existing-rounds", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="3 rounds, one seed, to the temporary folder")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.rounds, args.existing_rounds = args.seeds[:1], 3, 3
    runs: dict[str, list[dict]] = {}
    for name, (kind, arg) in CASES.items():
        for seed in args.seeds if name in MAIN_CASES else args.seeds[:1]:
            res = (reference(seed, args.rounds, arg) if kind == "reference"
                   else existing_app(seed, args.existing_rounds, arg))
            runs.setdefault(name, []).append({"seed": seed, **res})
            print(name, seed, res, flush=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "seed"} for name, rs in runs.items()}
    fp32 = {"reference": med["reference: fp32 both ways"], "existing": med["existing app: plain FedAvg"]}
    rows = []
    for name, m in med.items():
        base = fp32[CASES[name][0]]
        rows.append({"case": name, "accuracy": m["accuracy"], "mb": m["counted-mb"],
                     "ratio": base["counted-mb"] / m["counted-mb"],
                     "accuracy-vs-fp32": m["accuracy"] - base["accuracy"],
                     "reported-over-counted": m.get("reported-mb", m["counted-mb"]) / m["counted-mb"]})
    print(f"{'case':42} {'accuracy':>8} {'MB':>9} {'ratio':>7} {'vs fp32':>8} {'reported/counted':>16}")
    for r in rows:
        print(f"{r['case']:42} {r['accuracy']:8.4f} {r['mb']:9.3f} {r['ratio']:7.1f} {r['accuracy-vs-fp32']:+8.4f} "
              f"{r['reported-over-counted']:16.4f}")
    path = output_path("wire", args.out, args.quick)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"command": " ".join(["python", "benchmarks/wire.py", *sys.argv[1:]]),
                                "seeds": args.seeds, "rounds": args.rounds, "existing-rounds": args.existing_rounds,
                                "medians": rows, "table": table(rows, args.seeds), "runs": runs}, indent=1))
    print("written to", shown(path))


if __name__ == "__main__":
    main()
