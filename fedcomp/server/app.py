"""The fedcomp ServerApp: run config -> CompressedStrategy(inner).start(...) -> table, files."""

from __future__ import annotations

import time
from logging import INFO

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAdam, FedAvg, Strategy

from ..client.training import evaluate
from ..config import AppConfig
from ..data import DataConfig, load_test_set
from ..models import build_model
from ..strategies import CompressedStrategy
from .results import HEADER, MB, format_row, plot_rounds, resolve_results_dir, write_json

app = ServerApp()


def build_inner(cfg: AppConfig) -> Strategy:
    """The inner Flower strategy named by run config ``strategy`` ("fedavg" or "fedadam").

    Clients are evaluated centrally only (``fraction_evaluate = 0``).
    """
    common = dict(
        fraction_train=cfg.fraction_train, fraction_evaluate=0.0, min_train_nodes=cfg.min_train_nodes,
        min_evaluate_nodes=0, min_available_nodes=cfg.min_available_nodes,
    )
    if cfg.strategy == "fedadam":
        return FedAdam(**common, eta=cfg.server_lr, eta_l=cfg.lr)
    return FedAvg(**common)


class RoundRecorder:
    """Collects one record per round, prints the table line, rewrites ``metrics.json``."""

    def __init__(self, cfg: AppConfig, strategy: CompressedStrategy, out_dir, run_config: dict) -> None:
        self.cfg, self.strategy, self.out_dir = cfg, strategy, out_dir
        self.rounds: list[dict] = []
        self.cum_mb = 0.0
        self.run_config = run_config
        test = load_test_set(DataConfig(cfg.dataset, cfg.partitioner, cfg.dirichlet_alpha, cfg.seed))
        self.test = test
        self.model = build_model(cfg.model, tuple(test.tensors[0].shape[1:]))
        self.t0 = time.perf_counter()

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Flower ``evaluate_fn``: evaluate the global model on the held-out test split."""
        self.model.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = evaluate(self.model, self.test, torch.device("cpu"))
        rec: dict = {"round": server_round, "accuracy": acc, "loss": loss}
        h = self.strategy.history.get(server_round)
        if h is not None:
            self.cum_mb += h["upload-bytes"] / MB
            rec.update({
                "upload-mb": h["upload-bytes"] / MB, "cumulative-upload-mb": self.cum_mb,
                "download-mb": h["download-bytes"] / MB, **h,
            })
        rec["elapsed-seconds"] = time.perf_counter() - self.t0
        if server_round == 0:
            log(INFO, "fedcomp  %s", HEADER)
        log(INFO, "fedcomp  %s", format_row(rec))
        self.rounds.append(rec)
        self.save()
        return MetricRecord({"accuracy": acc, "loss": loss})

    def save(self) -> None:
        """Write ``metrics.json`` (atomically)."""
        write_json(self.out_dir / "metrics.json", {
            "codec": self.strategy.codec.describe(), "run-config": self.run_config, "rounds": self.rounds,
        })


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the federation described by the run config and write ``metrics.json`` and ``plot.png``."""
    cfg = AppConfig.from_run_config(context.run_config)
    torch.manual_seed(cfg.seed)
    out_dir = resolve_results_dir(cfg.results_dir, cfg.codec.compressor)
    strategy = CompressedStrategy.from_codec_config(build_inner(cfg), cfg.codec)
    recorder = RoundRecorder(cfg, strategy, out_dir, dict(context.run_config))
    model = build_model(cfg.model, tuple(recorder.test.tensors[0].shape[1:]))
    train_config = ConfigRecord({"seed": cfg.seed})
    strategy.start(
        grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=cfg.num_server_rounds,
        timeout=cfg.round_timeout, train_config=train_config, evaluate_fn=recorder,
    )
    plot_rounds(recorder.rounds, out_dir / "plot.png", f"fedcomp: {strategy.codec.describe()}")
    last = recorder.rounds[-1]
    log(INFO, "fedcomp  final accuracy %.4f after %d rounds, %.3f MB uploaded in total",
        last["accuracy"], last["round"], recorder.cum_mb)
    log(INFO, "fedcomp  results written to %s (metrics.json, plot.png)", out_dir)
