"""The ServerApp path of ``secagg = true``: Flower's legacy ``DefaultWorkflow`` with
``CompressedSecAggPlusWorkflow`` and ``SharedRandomKStrategy`` around a legacy FedAvg/FedAvgM/FedAdam.

Writes the same per-round table, ``metrics.json`` and ``plot.png`` as the plain path; bytes come
from the real SecAgg+ replies (``upload-bytes``: masked vectors; ``secagg-protocol-bytes``: keys
and shares of the four stages).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from logging import INFO
from typing import Any

import numpy as np
import torch
from flwr.common import Scalar, ndarrays_to_parameters
from flwr.common.logger import log
from flwr.server import LegacyContext, ServerConfig
from flwr.server.strategy import FedAdam, FedAvg, FedAvgM, Strategy
from flwr.server.workflow import DefaultWorkflow

from fedcomp.config import AppConfig
from fedcomp.task.data import DataConfig, load_test_set
from fedcomp.task.models import build_model
from fedcomp.privacy import NO_AMPLIFICATION, ClientLevelDP
from fedcomp.app.results import DP_HEADER, HEADER, MB, format_row, plot_rounds, write_json
from fedcomp.task.training import evaluate
from fedcomp.config.secagg import SecAggConfig, check_codec_under_secagg
from fedcomp.secagg.strategy import SharedRandomKStrategy
from fedcomp.secagg.workflow import CompressedSecAggPlusWorkflow


def secagg_requested(run_config: Mapping[str, Any]) -> bool:
    """Whether the run config asks for ``secagg = true`` (validated by :func:`run_secagg`).

    Raises
    ------
    ValueError
        ``secagg`` is not a bool (``"true"`` or ``1`` must not run without secure aggregation).
    """
    value = run_config.get("secagg", False)
    if not isinstance(value, bool):
        raise ValueError(f"run config 'secagg' must be true or false, got {value!r}")
    return value


def check_secagg_config(run_config: Mapping[str, Any]) -> SecAggConfig:
    """Validate the secure-aggregation run config before anything starts.

    Raises
    ------
    ValueError
        A codec or feature that cannot work under masking, or a bad ``secagg-*`` key.
    """
    check_codec_under_secagg(run_config)
    return SecAggConfig.from_run_config(run_config)


def build_legacy_inner(cfg: AppConfig, evaluate_fn, initial) -> Strategy:
    """Flower's legacy strategy for run config ``strategy`` (fedavg, fedavgm, fedadam), centrally
    evaluated only (``fraction_evaluate = 0``)."""
    common = {"fraction_fit": cfg.fraction_train, "fraction_evaluate": 0.0, "min_fit_clients": cfg.min_train_nodes,
                  "min_evaluate_clients": 0, "min_available_clients": cfg.min_available_nodes, "evaluate_fn": evaluate_fn,
                  "initial_parameters": initial, "accept_failures": True}
    if cfg.strategy == "fedadam":
        return FedAdam(**common, eta=cfg.server_lr, eta_l=cfg.lr)
    if cfg.strategy == "fedavgm":
        return FedAvgM(**common, server_learning_rate=cfg.server_lr, server_momentum=cfg.server_momentum)
    return FedAvg(**common)


class SecAggRecorder:
    """Centralised evaluation (legacy ``evaluate_fn``) plus the round's bytes: table line, metrics.json."""

    def __init__(self, cfg: AppConfig, sa: SecAggConfig, out_dir, run_config: dict) -> None:
        self.cfg, self.sa, self.out_dir, self.run_config = cfg, sa, out_dir, run_config
        self.test = load_test_set(DataConfig(cfg.dataset, cfg.partitioner, cfg.dirichlet_alpha, cfg.seed))
        self.model = build_model(cfg.model, tuple(self.test.tensors[0].shape[1:]))
        self.keys = list(self.model.state_dict().keys())
        self.rounds: list[dict] = []
        self.cum_mb = 0.0
        self.t0 = time.perf_counter()
        self.strategy: SharedRandomKStrategy | None = None
        self.workflow: CompressedSecAggPlusWorkflow | None = None

    def __call__(self, server_round: int, arrays: list[np.ndarray], config: dict) -> tuple[float, dict[str, Scalar]]:
        state = {k: torch.from_numpy(np.array(a, copy=True)) for k, a in zip(self.keys, arrays)}
        self.model.load_state_dict(state)
        loss, acc = evaluate(self.model, self.test, torch.device("cpu"))
        rec: dict[str, Any] = {"round": server_round, "accuracy": acc, "loss": loss}
        h = self.strategy.history.get(server_round) if self.strategy else None
        if h is not None and self.workflow is not None:
            wire = self.workflow.round_bytes
            up = wire["upload-bytes"]
            self.cum_mb += up / MB
            rec.update({**h, **wire, "upload-mb": up / MB, "cumulative-upload-mb": self.cum_mb,
                        "compression-ratio": h["dense-bytes"] / up if up else 0.0,
                        "bits-per-parameter": 8 * up / (h["num-replies"] * h["dimension"]),
                        "modulus-bits": self.workflow.round_modulus_bits})
        rec["elapsed-seconds"] = time.perf_counter() - self.t0
        dp = self.cfg.dp != "none"
        if server_round == 0:
            log(INFO, "fedcomp  %s %6s", HEADER + (DP_HEADER if dp else ""), "bits/p")
        bpp = rec.get("bits-per-parameter")
        log(INFO, "fedcomp  %s %6s", format_row(rec, dp), "-" if bpp is None else f"{bpp:6.3f}")
        self.rounds.append(rec)
        write_json(self.out_dir / "metrics.json", {
            "codec": self.strategy.describe() if self.strategy else "", "run-config": self.run_config,
            "secagg": {"clipping-range": self.sa.clipping_range, "quantization-range": self.sa.quantization_range,
                       "modulus-bits": self.sa.modulus_bits or "auto", "max-weight": self.sa.max_weight,
                       "shares": self.sa.shares, "threshold": self.sa.threshold, "pack": self.sa.pack,
                       "rotation": self.sa.rotation},
            "privacy": None if self.cfg.dp == "none" else {
                "mode": "client-level", "level": "client-level (a client's whole update) under SecAgg+: clients clip "
                "their shared k values, the server adds Gaussian noise to the unmasked sum",
                "delta": self.cfg.target_delta, "accountant": "rdp", "assumption": NO_AMPLIFICATION},
            "stopped": None, "rounds": self.rounds})
        return loss, {"accuracy": acc}


def run_secagg(grid, context, cfg: AppConfig, out_dir) -> list[dict]:
    """Run ``num-server-rounds`` rounds of SecAgg+ with shared-seed random-k; returns the round records.

    Raises
    ------
    ValueError
        A codec or feature that cannot work under masking, or a bad ``secagg-*`` key.
    fedcomp.secagg.SecAggHalted
        A round halted because the fixed ``secagg-modulus-bits`` cannot hold the sampled clients'
        sum (the run stops after that round; the message names the fix).
    """
    sa = check_secagg_config(context.run_config)
    recorder = SecAggRecorder(cfg, sa, out_dir, dict(context.run_config))
    initial = ndarrays_to_parameters([v.numpy().copy() for v in recorder.model.state_dict().values()])
    density = cfg.codec.density if cfg.codec.compressor == "randomk" else 1.0
    strategy = SharedRandomKStrategy(build_legacy_inner(cfg, recorder, initial), density, rotation=sa.rotation,
                                     error_feedback=cfg.codec.error_feedback, seed=cfg.seed, keys=recorder.keys,
                                     pack=sa.pack, max_weight=sa.max_weight,
                                     client_dp=ClientLevelDP(cfg.clipping_norm, cfg.noise_multiplier, cfg.target_delta)
                                     if cfg.dp == "client-level" else None)
    workflow = CompressedSecAggPlusWorkflow(sa.shares, sa.threshold, modulus_bits=sa.modulus_bits,
                                            max_weight=sa.max_weight, clipping_range=sa.clipping_range,
                                            quantization_range=sa.quantization_range, timeout=cfg.round_timeout)
    recorder.strategy, recorder.workflow = strategy, workflow
    log(INFO, "fedcomp  secure aggregation (Flower SecAgg+): %s, c = %g, Q = 2**%d, modulus %s, max-weight %g%s",
        strategy.describe(), sa.clipping_range, sa.quantization_bits,
        f"2**{sa.modulus_bits}" if sa.modulus_bits else "auto", sa.max_weight, ", packed" if sa.pack else "")
    legacy = LegacyContext(context, config=ServerConfig(num_rounds=cfg.num_server_rounds,
                                                        round_timeout=cfg.round_timeout), strategy=strategy)
    DefaultWorkflow(fit_workflow=workflow)(grid, legacy)
    if recorder.rounds:
        plot_rounds(recorder.rounds, out_dir / "plot.png", f"fedcomp: {strategy.describe()}")
        last = recorder.rounds[-1]
        log(INFO, "fedcomp  final accuracy %.4f after %d rounds, %.3f MB of masked vectors uploaded in total",
            last["accuracy"], last["round"], recorder.cum_mb)
    log(INFO, "fedcomp  results written to %s (metrics.json, plot.png)", out_dir)
    return recorder.rounds
