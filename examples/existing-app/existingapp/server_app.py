"""ServerApp of the example: FedAvg for ``num-server-rounds`` rounds."""

import json
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedcomp.strategies import CompressedStrategy  # fedcomp

from .task import Net

app = ServerApp()


def make_strategy(run_config) -> CompressedStrategy:
    """The strategy of this app (a function so that tests can run it on their own grid)."""
    fedavg = FedAvg(
        fraction_train=float(run_config["fraction-train"]),
        fraction_evaluate=float(run_config["fraction-evaluate"]),
        min_train_nodes=int(run_config["min-nodes"]),
        min_evaluate_nodes=int(run_config["min-nodes"]),
        min_available_nodes=int(run_config["min-nodes"]),
    )
    return CompressedStrategy(fedavg, compressor="sign")  # fedcomp: was `return fedavg`


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run FedAvg and print the final accuracy reported by the clients."""
    cfg = context.run_config
    strategy = make_strategy(cfg)
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(Net().state_dict()),
        train_config=ConfigRecord({"lr": float(cfg["lr"])}),
        num_rounds=int(cfg["num-server-rounds"]),
    )
    last = max(result.evaluate_metrics_clientapp, default=None)
    acc = result.evaluate_metrics_clientapp[last]["eval-acc"] if last is not None else float("nan")
    print(f"existingapp: finished {cfg['num-server-rounds']} rounds, client eval-acc {acc:.4f}")
    if cfg.get("results-file"):  # optional: the per-round metrics as JSON (an absolute path)
        rounds = {r: dict(m) for r, m in result.train_metrics_clientapp.items()}
        Path(str(cfg["results-file"])).write_text(json.dumps({"train": rounds, "eval-acc": acc}))
