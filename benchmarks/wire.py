"""Bytes on the wire: every message's serialised content, both ways, evaluation included.

Counts what Flower sends (``recorddict_to_proto(message.content).ByteSize()`` of every message the
ServerApp sends and every reply it receives, train and evaluate) with a Grid of its own that weighs
each message it carries, independently of fedcomp's counters, and compares the two. Two federations,
each with its fp32 counterpart in the same run:

- ``reference``: the reference app as the README runs it (digits, CNN, 10 SuperNodes, federated
  evaluation on half of them every round, 50 rounds), its default codecs against ``compressor = "none"``;
- ``existing-app``: ``examples/existing-app`` (an ordinary Flower app, a CNN of 53,002 parameters on
  digits, 10 clients, every client evaluates every round, its own run config) with the README's two
  lines (``compressor="sign"``, and the library's default codec; the library's default download) and
  with other downloads, against the same app without them (plain FedAvg); also a few runs at one local
  epoch (5 steps a round) and with half of the clients a round.

Run: ``python benchmarks/wire.py [--seeds 42 43 44] [--rounds 50] [--jobs 2] [--quick]``; prints a
table (medians over seeds) and writes ``benchmarks/results/wire.json`` (``--quick``: 3 rounds, one
seed, into the temporary folder, see ``outputs.py``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import multiprocessing
import json
import pathlib
import shlex
import statistics
import sys
import tempfile
import threading
import tomllib

import numpy as np
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
        self._lock = threading.Lock()  # Flower's legacy server sends from several threads at once

    @property
    def run(self):
        """Flower's legacy compatibility layer reads ``grid.run.run_id``."""
        from types import SimpleNamespace

        return SimpleNamespace(run_id=1)

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        down = sum(recorddict_to_proto(m.content).ByteSize() for m in messages)
        replies = list(super().send_and_receive(messages, timeout=timeout))
        up = sum(recorddict_to_proto(r.content).ByteSize() for r in replies if not r.has_error())
        with self._lock:
            self.down, self.up = self.down + down, self.up + up
        return replies


def reference(seed: int, rounds: int, compressor: str | None, **settings) -> dict:
    """The reference app in process; ``compressor``: None for its defaults, "none" for fp32; ``settings``:
    run-config keys (e.g. ``secagg``)."""
    with tempfile.TemporaryDirectory() as out:
        rc = {"results-dir": out, "seed": seed, "num-server-rounds": rounds, **settings}
        if compressor is not None:
            rc["compressor"] = compressor
        grid = WeighingGrid(reference_client_app, 10, rc)
        reference_main(grid, Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=rc))
        last = json.loads((pathlib.Path(out) / "metrics.json").read_text())["rounds"][-1]
    return {"accuracy": last["accuracy"], "counted-mb": (grid.down + grid.up) / 1e6,
            "reported-mb": last["cumulative-mb"], "reported-ratio": last["cumulative-ratio-both-ways"]}


def existing_app(seed: int, rounds: int, lines: dict | None, **settings) -> dict:
    """``examples/existing-app`` in process with its own run config (10 nodes; ``settings`` override run-config
    keys, e.g. ``local_epochs=1``); ``lines``: CompressedStrategy's arguments (None: plain FedAvg)."""
    sys.path.insert(0, str(REPO / "examples" / "existing-app"))
    client = importlib.import_module("existingapp.client_app")
    task = importlib.import_module("existingapp.task")
    import torch

    torch.manual_seed(seed)
    rc = _example_config(rounds, settings)
    fedavg = FedAvg(fraction_train=float(rc["fraction-train"]), fraction_evaluate=float(rc["fraction-evaluate"]),
                    min_available_nodes=10, min_train_nodes=int(10 * rc["fraction-train"]),
                    min_evaluate_nodes=int(10 * rc["fraction-evaluate"]))
    strategy = fedavg if lines is None else CompressedStrategy(fedavg, **lines)
    app = client.app if lines is not None else _plain_client(client)
    grid = WeighingGrid(app, 10, rc)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(task.Net().state_dict()), num_rounds=rounds,
                            train_config=ConfigRecord({"lr": float(rc["lr"])}))
    acc = result.evaluate_metrics_clientapp[rounds]["eval-acc"]
    out = {"accuracy": float(acc), "counted-mb": (grid.down + grid.up) / 1e6}
    if lines is not None:
        h = strategy.history
        out["reported-mb"] = sum(h[r]["wire-bytes-down"] + h[r]["wire-bytes-up"] for r in h) / 1e6
    return out


def legacy_app(seed: int, rounds: int, lines: dict | None, **settings) -> dict:
    """The example's model, data and training on Flower's legacy API (a ``NumPyClient``, a legacy FedAvg,
    ``ServerApp(server_fn=...)``), 10 clients, its run config; ``lines``: ``LegacyCompressedStrategy``'s
    arguments, with ``CompressedNumPyClient`` on the clients (None: plain FedAvg)."""
    from flwr.client import NumPyClient
    from flwr.clientapp import ClientApp
    from flwr.common import ndarrays_to_parameters
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig
    from flwr.server.strategy import FedAvg as LegacyFedAvg

    from fedcomp.client.numpy_client import CompressedNumPyClient
    from fedcomp.strategies.legacy_strategy import LegacyCompressedStrategy

    sys.path.insert(0, str(REPO / "examples" / "existing-app"))
    task = importlib.import_module("existingapp.task")
    import torch

    torch.manual_seed(seed)
    rc = _example_config(rounds, settings)
    names = list(task.Net().state_dict())

    class Client(NumPyClient):
        def __init__(self, pid: int, nparts: int) -> None:
            self.pid, (self.trainset, self.testset) = pid, task.load_data(pid, nparts)

        def _net(self, parameters):
            net = task.Net()
            net.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in zip(names, parameters)})
            return net

        def fit(self, parameters, config):
            net = self._net(parameters)
            loss = task.train(net, self.trainset, int(rc["local-epochs"]), float(config["lr"]), seed=self.pid)
            return [v.numpy() for v in net.state_dict().values()], len(self.trainset[1]), {"train-loss": loss}

        def evaluate(self, parameters, config):
            loss, acc = task.test(self._net(parameters), self.testset)
            return float(loss), len(self.testset[1]), {"eval-acc": float(acc)}

    def client_fn(context: Context):
        client = Client(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))
        return (client if lines is None else CompressedNumPyClient(client, state=context.state)).to_client()

    accuracy = []

    def mean_accuracy(metrics):
        accuracy.append(sum(n * m["eval-acc"] for n, m in metrics) / sum(n for n, _ in metrics))
        return {"eval-acc": accuracy[-1]}

    fedavg = LegacyFedAvg(fraction_fit=float(rc["fraction-train"]), fraction_evaluate=float(rc["fraction-evaluate"]),
                          min_fit_clients=int(10 * rc["fraction-train"]),
                          min_evaluate_clients=int(10 * rc["fraction-evaluate"]), min_available_clients=10,
                          initial_parameters=ndarrays_to_parameters([v.numpy() for v in
                                                                     task.Net().state_dict().values()]),
                          on_fit_config_fn=lambda r: {"lr": float(rc["lr"])},
                          evaluate_metrics_aggregation_fn=mean_accuracy)
    strategy = fedavg if lines is None else LegacyCompressedStrategy(fedavg, **lines)
    grid = WeighingGrid(ClientApp(client_fn=client_fn), 10, rc)
    ServerApp(server_fn=lambda context: ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=rounds)))(
        grid, Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=rc))
    out = {"accuracy": float(accuracy[-1]), "counted-mb": (grid.down + grid.up) / 1e6}
    if lines is not None:
        out["reported-mb"] = sum(h["wire-bytes-down"] + h["wire-bytes-up"] for h in strategy.history.values()) / 1e6
    return out


def _example_config(rounds: int, settings: dict) -> dict:
    """``examples/existing-app``'s run config for a run of ``rounds`` with ``settings`` (Python names)."""
    project = tomllib.loads((REPO / "examples" / "existing-app" / "pyproject.toml").read_text())
    rc = project["tool"]["flwr"]["app"]["config"]
    rc.update({"num-server-rounds": rounds, "min-nodes": 10, "results-file": "",
               **{k.replace("_", "-"): v for k, v in settings.items()}})
    return rc


def _plain_client(client_module):
    """The example's ClientApp without ``compression_mod`` (what the app was before the two lines)."""
    from flwr.clientapp import ClientApp

    plain = ClientApp()
    plain.train()(client_module.train_fn)
    plain.evaluate()(client_module.evaluate_fn)
    return plain


#: case -> (federation, its fp32 case, the strategy's arguments, run-config overrides)
SECURE_FP32 = "secure: fp32 both ways, no federated evaluation"
CASES = {
    "reference: fp32 both ways": ("reference", None, "none", {}),
    "reference: defaults": ("reference", None, None, {}),
    "existing app: plain FedAvg": ("existing", None, None, {}),
    "existing app + two lines, sign": ("existing", None, {"compressor": "sign"}, {}),
    "existing app + two lines, default codec": ("existing", None, {}, {}),
    "existing app, sign, int8 download": ("existing", None, {"compressor": "sign", "downstream": "int8"}, {}),
    "existing app, sign, dense download": ("existing", None, {"compressor": "sign", "downstream": "none"}, {}),
    "existing app, 1 local epoch: plain FedAvg": ("existing", None, None, {"local_epochs": 1}),
    "existing app, 1 local epoch: sign": ("existing", "existing app, 1 local epoch: plain FedAvg",
                                          {"compressor": "sign"}, {"local_epochs": 1}),
    "existing app, 1 local epoch: default codec": ("existing", "existing app, 1 local epoch: plain FedAvg", {},
                                                   {"local_epochs": 1}),
    "existing app, half the clients: plain FedAvg": ("existing", None, None,
                                                     {"fraction_train": 0.5, "fraction_evaluate": 0.5}),
    "existing app, half the clients: sign": ("existing", "existing app, half the clients: plain FedAvg",
                                             {"compressor": "sign"}, {"fraction_train": 0.5, "fraction_evaluate": 0.5}),
    "existing app, half the clients: default codec": ("existing", "existing app, half the clients: plain FedAvg", {},
                                                      {"fraction_train": 0.5, "fraction_evaluate": 0.5}),
    "legacy API: plain FedAvg": ("legacy", None, None, {}),
    "legacy API + two lines, sign": ("legacy", None, {"compressor": "sign"}, {}),
    "legacy API + two lines, default codec": ("legacy", None, {}, {}),
    # SecAgg+ runs no federated evaluation: its fp32 counterpart is the reference app without it
    "secure: fp32 both ways, no federated evaluation": ("reference", None, "none", {"fraction-evaluate": 0.0}),
    "secagg = true (default download)": ("reference", SECURE_FP32, None, {"secagg": True}),
    "secagg = true, dense download": ("reference", SECURE_FP32, None, {"secagg": True, "downstream": "none"}),
}
#: The fp32 case of each federation, for the cases that name none.
FP32 = {"reference": "reference: fp32 both ways", "existing": "existing app: plain FedAvg",
        "legacy": "legacy API: plain FedAvg"}


def _fp32_of(name: str) -> str:
    """The fp32 case ``name`` is measured against (itself for an fp32 case)."""
    kind, fp32, arg, _ = CASES[name]
    plain = (kind in ("existing", "legacy") and arg is None) or arg == "none"
    return fp32 or (name if plain else FP32[kind])


def summarise(runs: dict[str, list[dict]]) -> list[dict]:
    """One row per case: medians over its runs, the ratio and accuracy against its fp32 case."""
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "seed"} for name, rs in runs.items()}
    rows = []
    for name, m in med.items():
        base = med[_fp32_of(name)]
        rows.append({"case": name, "accuracy": m["accuracy"], "mb": m["counted-mb"],
                     "ratio": base["counted-mb"] / m["counted-mb"],
                     "accuracy-vs-fp32": m["accuracy"] - base["accuracy"],
                     # None: a run without fedcomp's own count (plain FedAvg, the legacy API)
                     "reported-over-counted": m["reported-mb"] / m["counted-mb"] if "reported-mb" in m else None})
    return rows


def _threads(jobs: int) -> None:
    """Each of ``jobs`` worker processes takes its share of the CPU cores for torch."""
    import os

    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // jobs))


def run_case(name: str, seed: int, rounds: int, existing_rounds: int) -> dict:
    """One run of ``name`` (a key of `CASES`) at ``seed``."""
    kind, _, arg, settings = CASES[name]
    if kind == "reference":
        return reference(seed, rounds, arg, **settings)
    if kind == "legacy":
        return legacy_app(seed, existing_rounds, arg, **settings)
    return existing_app(seed, existing_rounds, arg, **settings)


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def table(rows: list[dict], seeds: list[int]) -> dict:
    """The page's table (``docs/hooks/generate.py`` renders it): one row per case, medians over seeds."""
    out = []
    for r in rows:
        n = len(seeds) if r["case"] in MAIN_CASES else 1
        out.append([r["case"], f"{100 * r['accuracy']:.1f} %", f"{100 * r['accuracy-vs-fp32']:+.1f}",
                    f"{r['mb']:.3f}", f"**{r['ratio']:.1f}x**", _share(r["reported-over-counted"]), str(n)])
    return {"columns": ["case", "final accuracy", "points vs its fp32", "MB on the wire, both ways",
                        "fewer bytes than fp32", "fedcomp's count / outside count", "seeds"], "rows": out}


#: The cases run on every seed (the two lines, the same at one local epoch, SecAgg+); the others on the first seed.
MAIN_CASES = list(CASES)[:5] + [c for c in CASES if c.startswith(("existing app, 1 local epoch", "legacy API"))] + [
    SECURE_FP32, "secagg = true (default download)", "secagg = true, dense download"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--existing-rounds", type=int, default=30)
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (each in its own process)")
    ap.add_argument("--quick", action="store_true", help="3 rounds, one seed, to the temporary folder")
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", nargs="+", default=[], help="run only the cases whose name contains one of these; the "
                    "other cases' runs are kept from the result file written before (same seeds and rounds)")
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.rounds, args.existing_rounds = args.seeds[:1], 3, 3
    path = output_path("wire", args.out, args.quick)
    chosen = [name for name in CASES if not args.only or any(p in name for p in args.only)]
    if args.quick:  # nothing is merged into a quick run: the chosen cases' fp32 cases run too
        chosen += [c for c in CASES if c not in chosen and any(_fp32_of(n) == c for n in chosen)]
    runs: dict[str, list[dict]] = {name: [] for name in (chosen if args.quick else CASES)}
    command = shlex.join(["python", "benchmarks/wire.py", *sys.argv[1:]])
    if args.only and not args.quick:
        before = json.loads(path.read_text())
        command = f"{before['command']} && {command}"
        if (before["seeds"], before["rounds"], before["existing-rounds"]) != (args.seeds, args.rounds,
                                                                             args.existing_rounds):
            raise SystemExit(f"--only: {shown(path)} was written with other seeds or rounds")
        runs.update({name: rs for name, rs in before["runs"].items() if name in CASES and name not in chosen})
    todo = [(name, seed) for name in chosen for seed in (args.seeds if name in MAIN_CASES else args.seeds[:1])]
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=_threads, initargs=(args.jobs,)) as pool:
        futures = {pool.submit(run_case, name, seed, args.rounds, args.existing_rounds): (name, seed)
                   for name, seed in todo}
        for future in concurrent.futures.as_completed(futures):
            name, seed = futures[future]
            runs[name].append({"seed": seed, **future.result()})
            print(name, seed, runs[name][-1], flush=True)
    for rs in runs.values():
        rs.sort(key=lambda r: r["seed"])
    rows = summarise(runs)
    print(f"{'case':46} {'accuracy':>8} {'MB':>9} {'ratio':>7} {'vs fp32':>8} {'reported/counted':>16}")
    for r in rows:
        print(f"{r['case']:46} {r['accuracy']:8.4f} {r['mb']:9.3f} {r['ratio']:7.1f} {r['accuracy-vs-fp32']:+8.4f} "
              f"{_share(r['reported-over-counted']):>16}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"command": command,
                                "seeds": args.seeds, "rounds": args.rounds, "existing-rounds": args.existing_rounds,
                                "medians": rows, "table": table(rows, args.seeds), "runs": runs}, indent=1))
    print("written to", shown(path))


if __name__ == "__main__":
    main()
