"""One record per round for both ServerApp paths: evaluate the global model on the server's test
split, print the table line, rewrite ``metrics.json`` (and, on the plain path, the checkpoint).

`RoundRecorder` does what both paths share; what a path adds to a round's record comes from
its *round source*: `CompressedRounds` (``CompressedStrategy``'s histories) here, and
`fedcomp.app.secagg_server_app.SecAggRounds` (the SecAgg+ strategy and workflow).
"""

from __future__ import annotations

import math
import time
from logging import INFO
from typing import Any, Protocol

import numpy as np
import torch
from flwr.app import ArrayRecord, MetricRecord
from flwr.common.logger import log

from fedcomp.app import checkpoint
from fedcomp.app.data_record import DATA_KEY, data_settings
from fedcomp.app.results import DP_HEADER, HEADER, MB, format_row, write_json
from fedcomp.app.strategy_record import EXTRA_KEY, strategy_settings
from fedcomp.app.config import AppConfig
from fedcomp.privacy import NO_AMPLIFICATION, DPSGDConfig
from fedcomp.statedict import retie, tied_aliases, untie
from fedcomp.strategies import CompressedStrategy
from fedcomp.strategies.round_metrics import machine_counts, per_client
from fedcomp.task.data import DataConfig, load_test_set
from fedcomp.task.lora import LoraSettings, load_weights, lora_model
from fedcomp.task.models import build_model
from fedcomp.task.training import evaluate


class RoundSource(Protocol):
    """What a ServerApp path adds to the shared round records."""

    #: Appended to the table's header line ("" for none).
    header_tail: str
    #: The run's privacy statement in ``metrics.json`` (None: no DP).
    privacy: dict | None

    def describe(self) -> str:
        """The codec label of ``metrics.json``."""

    def json_extra(self) -> dict:
        """``metrics.json`` keys between ``run-config`` and ``privacy``."""

    def stopped(self) -> str | None:
        """Why the run stopped early (None: it did not)."""

    def round_fields(self, server_round: int, recorder: RoundRecorder) -> dict:
        """The round's figures after ``round``/``accuracy``/``loss`` (updates the recorder's totals)."""

    def row_tail(self, rec: dict) -> str:
        """Appended to the round's table line."""

    def after_round(self, recorder: RoundRecorder, server_round: int, arrays: ArrayRecord) -> None:
        """Called after ``metrics.json`` is written for a round >= 1 (the checkpoint)."""


class RoundRecorder:
    """Collects one record per round, prints the table line, rewrites ``metrics.json``.

    Parameters
    ----------
    cfg : AppConfig
    source : RoundSource
        The path's round figures (`CompressedRounds`, ``SecAggRounds``).
    out_dir : pathlib.Path
        The results folder.
    run_config : dict
        The run config as given (written into ``metrics.json``).
    """

    def __init__(self, cfg: AppConfig, source: RoundSource, out_dir, run_config: dict) -> None:
        self.cfg, self.source, self.out_dir = cfg, source, out_dir
        self.rounds: list[dict] = []
        self.cum_mb = 0.0
        self.cum_down_mb = 0.0
        #: fp32 bytes both ways so far (each reply's dense update up, the dense model down), MB
        self.cum_dense_mb = 0.0
        self.run_config = run_config
        test = load_test_set(DataConfig(cfg.dataset, cfg.partitioner, cfg.dirichlet_alpha, cfg.seed))
        self.test = test
        if cfg.finetune == "lora":  # scoring only: the wire carries adapters, never base weights
            self.model = lora_model(LoraSettings.from_mapping(run_config))
        else:
            self.model = build_model(cfg.model, tuple(test.tensors[0].shape[1:]))
        #: Parameter names in model order, each tied tensor once (what travels: `fedcomp.statedict.untie`).
        self.keys = list(untie(self.model.state_dict()))
        self.t0 = time.perf_counter()
        self.last_eps = 0.0
        self.header_printed = False

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Flower ``evaluate_fn`` (Message API): evaluate the global model on the held-out test split."""
        load_weights(self.model, arrays, self.cfg.finetune == "lora")
        loss, acc = evaluate(self.model, self.test, torch.device("cpu"))
        self.record(server_round, loss, acc, arrays)
        return MetricRecord({"accuracy": acc, "loss": loss})

    def legacy_evaluate(self, server_round: int, arrays: list[np.ndarray], config: dict) -> tuple[float, dict]:
        """Flower's legacy ``evaluate_fn``: the same for ndarrays in model order."""
        received = {k: torch.from_numpy(np.array(a, copy=True)) for k, a in zip(self.keys, arrays)}
        self.model.load_state_dict(retie(received, tied_aliases(self.model.state_dict())))
        loss, acc = evaluate(self.model, self.test, torch.device("cpu"))
        self.record(server_round, loss, acc, None)
        return loss, {"accuracy": acc}

    def record(self, server_round: int, loss: float, acc: float, arrays: ArrayRecord | None) -> None:
        """Build the round's record, print its table line, rewrite ``metrics.json``; then the
        source's `RoundSource.after_round` (rounds >= 1 with ``arrays``)."""
        rec: dict = {"round": server_round, "accuracy": acc, "loss": loss}
        rec.update(self.source.round_fields(server_round, self))
        rec["elapsed-seconds"] = time.perf_counter() - self.t0
        dp = self.cfg.dp != "none"
        if not self.header_printed:  # round 0, or the first round of a resumed run
            log(INFO, "fedcomp  %s", HEADER + (DP_HEADER if dp else "") + self.source.header_tail)
            self.header_printed = True
        log(INFO, "fedcomp  %s", format_row(rec, dp) + self.source.row_tail(rec))
        self.rounds.append(rec)
        self.save()
        if server_round > 0 and arrays is not None:
            self.source.after_round(self, server_round, arrays)

    def add_bytes(self, upload: float, download: float = 0.0, dense: float = 0.0,
                  dense_both: float | None = None) -> None:
        """Add a round's bytes (upload, download, and ``dense``: one way's fp32 bytes of the round's
        replies, counted for each direction; or ``dense_both``: fp32 bytes both ways, counted as the
        messages travel) to the run's cumulative MB."""
        self.cum_mb += upload / MB
        self.cum_down_mb += download / MB
        self.cum_dense_mb += (2 * dense if dense_both is None else dense_both) / MB

    def near_chance_note(self, margin: float = 0.05) -> str:
        """A warning ("" if none) when the last round's accuracy is within ``margin`` of chance: the
        share of the test split's most frequent label (a model that always answers it scores that).

        The run finished, but it learned (almost) nothing: a learning rate, privacy noise or codec
        setting that does not train. Said in the run's last line, so nobody reads a plot of noise as
        a result."""
        if not self.rounds or len(self.rounds) < 2:
            return ""
        labels = self.test.tensors[1].reshape(-1).to(torch.int64)
        if labels.numel() == 0 or labels.min() < 0:
            return ""
        chance = float(torch.bincount(labels).max()) / labels.numel()
        acc = self.rounds[-1]["accuracy"]
        if acc is None or acc > chance + margin:
            return ""
        return (f"the run ended near chance: accuracy {acc:.4f} against {chance:.4f} for always answering the "
                f"most frequent label; it did not learn (check lr, the privacy noise, the codec settings)")

    def totals(self) -> dict:
        """The run's bytes both ways so far and their ratio to fp32 both ways (None: nothing sent)."""
        both = self.cum_mb + self.cum_down_mb
        return {"cumulative-mb": both,
                "cumulative-ratio-both-ways": self.cum_dense_mb / both if both and self.cum_dense_mb else None}

    def restore(self, meta: dict) -> None:
        """Continue from a checkpoint's metrics (resume)."""
        self.rounds = list(meta["rounds"])
        extra = meta.get("extra", {})
        # checkpoints older than the both-ways count lack these totals: sum the round records' bytes,
        # as the run counted them round by round (else the ratio divides new fp32 bytes by all bytes)
        def total(key: str, field: str, factor: float) -> float:
            if key in extra:
                return float(extra[key])
            values = (r.get(field) for r in self.rounds if isinstance(r, dict))
            return factor * sum(float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)
                                and v > 0) / MB

        self.cum_mb = float(extra.get("cum-mb", 0.0))
        self.cum_down_mb = total("cum-down-mb", "download-bytes", 1.0)
        self.cum_dense_mb = total("cum-dense-mb", "dense-bytes", 2.0)
        self.last_eps = float(extra.get("last-eps") or 0.0)

    def save(self) -> None:
        """Write ``metrics.json`` (atomically)."""
        write_json(self.out_dir / "metrics.json", {
            "codec": self.source.describe(), "run-config": self.run_config, **self.source.json_extra(),
            "privacy": self.source.privacy, "stopped": self.source.stopped(), "rounds": self.rounds,
        })


class CompressedRounds:
    """The round figures of the plain path: ``CompressedStrategy``'s histories, epsilon, the checkpoint.

    Parameters
    ----------
    cfg : AppConfig
    strategy : CompressedStrategy
    run_config : dict
    """

    header_tail = ""

    def __init__(self, cfg: AppConfig, strategy: CompressedStrategy, run_config: dict) -> None:
        self.cfg, self.strategy = cfg, strategy
        self.privacy = privacy_statement(cfg, run_config)

    def describe(self) -> str:
        return self.strategy.codec.describe()

    def json_extra(self) -> dict:
        """``resolved``: what the strategy runs with, every ``"auto"`` of the run config replaced."""
        ds = self.strategy.downstream
        return {"resolved": {"upload": self.strategy.codec.to_mapping(), "aggregation": self.strategy.aggregation,
                             "download": None if ds is None else ds.settings()}}

    def stopped(self) -> str | None:
        return self.strategy.stopped_reason or None

    def row_tail(self, rec: dict) -> str:
        return ""

    def round_fields(self, server_round: int, recorder: RoundRecorder) -> dict:
        """Bytes both ways and their running totals, the wrapper's metrics, epsilon of the round, the
        per-layer, per-client and failure figures; the federated evaluation where there was one."""
        rec: dict[str, Any] = {}
        h = self.strategy.history.get(server_round)
        if h is not None:
            # what travelled: every message's serialised content both ways, evaluation included
            # (`fedcomp.strategies.wire_bytes`); the payloads alone are upload-bytes / download-bytes
            up, down = h.get("wire-bytes-up", h["upload-bytes"]), h.get("wire-bytes-down", h["download-bytes"])
            recorder.add_bytes(up, down, h["dense-bytes"], h.get("wire-bytes-fp32"))
            rec.update({
                "upload-mb": up / MB, "cumulative-upload-mb": recorder.cum_mb,
                "download-mb": down / MB, "cumulative-download-mb": recorder.cum_down_mb,
                **recorder.totals(), **h,
            })
            now = _epsilon_now(rec)
            if self.cfg.dp != "none" and now is not None:
                rec["epsilon-round"] = math.inf if math.isinf(now) else now - recorder.last_eps
                recorder.last_eps = now
            rec["layers"] = self.strategy.layer_history.get(server_round, {})
            clients = self.strategy.client_history.get(server_round, [])
            rec["client-machines"] = machine_counts(clients)
            # per node id: peak RSS and container memory limit (MiB), failed clients with the reason
            rec["client-peak-rss"] = per_client(clients, "client-peak-rss-mb")
            rec["client-memory-limit"] = per_client(clients, "client-memory-limit-mb")
            rec["failures"] = self.strategy.failure_history.get(server_round, [])
            rec["evaluate-failures"] = self.strategy.evaluate_failure_history.get(server_round, [])
        fed = self.strategy.evaluate_history.get(server_round)
        if fed is not None:  # federated evaluation: sampled clients on their own data, weighted by examples
            rec.update({"federated-accuracy": fed.get("eval-acc"), "federated-loss": fed.get("eval-loss"),
                        "federated-num-replies": fed["num-replies"]})
        return rec

    def after_round(self, recorder: RoundRecorder, server_round: int, arrays: ArrayRecord) -> None:
        """Write the checkpoint of the round (`fedcomp.app.checkpoint`)."""
        checkpoint.save(recorder.out_dir, server_round, {k: a.numpy() for k, a in arrays.items()}, self.strategy,
                        recorder.rounds, {"cum-mb": recorder.cum_mb, "cum-down-mb": recorder.cum_down_mb,
                                          "cum-dense-mb": recorder.cum_dense_mb,
                                          "last-eps": recorder.last_eps, "privacy-settings": privacy_settings(self.cfg),
                                          "codec-settings": self.cfg.codec.to_mapping(),
                                          EXTRA_KEY: strategy_settings(self.cfg), DATA_KEY: data_settings(self.cfg)})


def privacy_settings(cfg: AppConfig) -> dict:
    """The run-config values a resumed run must keep for its epsilon to stay valid."""
    return {"dp": cfg.dp, "clipping-norm": cfg.clipping_norm, "noise-multiplier": cfg.noise_multiplier,
            "target-delta": cfg.target_delta, "client-sampling": cfg.client_sampling,
            "fraction-train": cfg.fraction_train}


def _epsilon_now(rec: dict) -> float | None:
    """Cumulative epsilon of a round record: client-level/local ``epsilon``, else DP-SGD's max."""
    for key in ("epsilon", "epsilon-max"):
        if rec.get(key) is not None:
            return float(rec[key])
    return None


def privacy_statement(cfg: AppConfig, run_config: dict | None = None) -> dict | None:
    """What the run's DP mode does and does not guarantee (written into metrics.json); the
    accountant of DP-SGD is the run config's ``accountant``."""
    if cfg.dp == "none":
        return None
    level = {"dp-sgd": "sample-level (one training example), on each client, Opacus DP-SGD",
             "client-level": "client-level (a client's whole update), DP-FedAvg on the server",
             "local": "client-level, local: each client clips and noises its own update before compressing",
             "distributed": "client-level, distributed under SecAgg+: each client adds its share of Skellam "
                            "noise"}[cfg.dp]
    accountant = "rdp"  # client-level and local DP: Rényi DP of the Gaussian mechanism, per round
    if cfg.dp == "dp-sgd":
        accountant = (run_config or {}).get("accountant", DPSGDConfig.accountant)
    return {"mode": cfg.dp, "level": level, "delta": cfg.target_delta, "accountant": accountant,
            "assumption": (NO_AMPLIFICATION if cfg.client_sampling != "poisson" or cfg.dp != "client-level" else
                           f"clients Poisson-sampled by the server with probability q = {cfg.fraction_train} per round "
                           "from the fixed population of connected nodes: amplification by sampling applies")
            if cfg.dp != "dp-sgd" else
            "Poisson sampling of examples within each client at rate logical-batch / N; one accountant per client "
            "for the whole run; epsilon-max / epsilon-median over the clients that replied",
            "max-epsilon": cfg.max_epsilon or None}


__all__ = ["CompressedRounds", "RoundRecorder", "RoundSource", "privacy_settings", "privacy_statement"]
