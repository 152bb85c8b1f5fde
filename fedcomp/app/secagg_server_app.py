"""The ServerApp path of ``secagg = true``: Flower's legacy ``DefaultWorkflow`` with
``CompressedSecAggPlusWorkflow`` and ``SharedRandomKStrategy`` around a legacy FedAvg/FedAvgM/FedAdam.

Writes the same per-round table, ``metrics.json`` and ``plot.png`` as the plain path. The model
travels by the run's download (`fedcomp.download.secagg`; ``downstream = "none"``: dense). Bytes are
counted as Flower serialises every message of the four stages both ways (``wire-bytes-*``, the MB
columns and the ratio both ways, against a plain app sending the model dense both ways); of them,
``upload-bytes`` are the masked vectors and ``secagg-protocol-bytes`` the keys and shares.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from logging import INFO, WARNING
from typing import Any

from flwr.common import ndarrays_to_parameters
from flwr.common.logger import log
from flwr.server import LegacyContext, ServerConfig
from flwr.server.workflow import DefaultWorkflow

from fedcomp.app.inner import build_inner
from fedcomp.app.recorder import RoundRecorder
from fedcomp.app.results import MB, plot_rounds
from fedcomp.app.config import AppConfig
from fedcomp.config.secagg import SecAggConfig, check_codec_under_secagg, resolve_secure_defaults, secure_defaults_note
from fedcomp.privacy import NO_AMPLIFICATION, ClientLevelDP
from fedcomp.privacy.distributed import DistributedDP
from fedcomp.download.options import Download
from fedcomp.download.sender import Downstream
from fedcomp.download.secagg import SecAggDownload
from fedcomp.secagg.strategy import SharedRandomKStrategy
from fedcomp.statedict import untie
from fedcomp.secagg.workflow import CompressedSecAggPlusWorkflow


def secagg_requested(run_config: Mapping[str, Any]) -> bool:
    """Whether the run config asks for ``secagg = true`` (validated by `run_secagg`).

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


def distributed_dp(cfg: AppConfig, sa: SecAggConfig) -> DistributedDP | None:
    """``dp = "distributed"``'s noise and accountant from the run config (None for any other ``dp``).

    Raises
    ------
    ValueError
        A bad ``clipping-norm``, ``noise-multiplier`` or ``target-delta``, or ``secagg-clipping-range``
        not above ``clipping-norm`` (naming the keys; `fedcomp.privacy.distributed.DistributedDP`).
    """
    if cfg.dp != "distributed":
        return None
    return DistributedDP(cfg.clipping_norm, cfg.noise_multiplier, sa.clipping_range, sa.quantization_range,
                         cfg.target_delta)


class SecAggRounds:
    """The round figures of the SecAgg+ path (a `fedcomp.app.recorder.RoundSource`): the strategy's
    history, the bytes of the real SecAgg+ replies, bits per parameter; ``secagg`` settings in
    ``metrics.json``; no checkpoint.

    Parameters
    ----------
    cfg : AppConfig
    sa : SecAggConfig
        The ``secagg-*`` settings (written into ``metrics.json``).
    """

    header_tail = f" {'bits/p':>6}"

    def __init__(self, cfg: AppConfig, sa: SecAggConfig) -> None:
        self.sa = sa
        self.strategy: SharedRandomKStrategy | None = None
        self.workflow: CompressedSecAggPlusWorkflow | None = None
        self.privacy = None if cfg.dp == "none" else {
            "mode": "client-level", "level": "client-level (a client's whole update) under SecAgg+: clients clip "
            "their shared k values, the server adds Gaussian noise to the unmasked sum",
            "delta": cfg.target_delta, "accountant": "rdp", "assumption": NO_AMPLIFICATION}
        if cfg.dp == "distributed":
            self.privacy = {
                "mode": "distributed", "level": "client-level (a client's whole update), distributed under SecAgg+: "
                "clients clip their shared k values and add their shares of Skellam noise; the server unmasks only "
                "the noised sum (private to the server too, if it follows the SecAgg+ protocol)",
                "delta": cfg.target_delta, "accountant": "rdp (Skellam, Agarwal et al. 2021), the noise of the "
                "clients whose vectors were summed", "assumption": NO_AMPLIFICATION + "; the guarantee is (epsilon, "
                "delta + (1 + e^epsilon) * dp-overflow-bound)"}

    def describe(self) -> str:
        return self.strategy.describe() if self.strategy else ""

    def json_extra(self) -> dict:
        sa = self.sa
        return {"secagg": {"clipping-range": sa.clipping_range, "quantization-range": sa.quantization_range,
                           "modulus-bits": sa.modulus_bits or "auto", "max-weight": sa.max_weight,
                           "shares": sa.shares, "threshold": sa.threshold, "pack": sa.pack, "rotation": sa.rotation,
                           "server-lr": sa.server_lr, "server-lr-decay": sa.server_lr_decay}}

    def stopped(self) -> str | None:
        return getattr(self.strategy, "stopped_reason", "") or None

    def round_fields(self, server_round: int, recorder: RoundRecorder) -> dict:
        """The strategy's round metrics, the workflow's bytes and their running total, the download
        (the dense model each replying client was sent), the ratio against dense fp32 (computed by the
        server from what it received) and both ways, bits per parameter
        and the modulus of the round; for a round that applied no sum, ``skipped`` with the reason."""
        h = self.strategy.history.get(server_round) if self.strategy else None
        if h is None or self.workflow is None:
            skipped = self.workflow.round_skipped.get(server_round) if self.workflow else None
            return {} if skipped is None else {"skipped": skipped}
        wire = self.workflow.round_bytes
        sent = self.workflow.wire.get(server_round)  # every message of the round's four stages, serialised
        up, down = sent["wire-bytes-up"], sent["wire-bytes-down"]
        recorder.add_bytes(up, down, h["dense-bytes"], sent["wire-bytes-fp32"])
        download = self.workflow.download
        model_down = float(sum(download.sent_bytes.values())) if download else h["dense-bytes"]
        eps = {}
        if isinstance(h.get("epsilon"), float):  # client-level or distributed DP: this round's increase
            eps["epsilon-round"] = math.inf if math.isinf(h["epsilon"]) else h["epsilon"] - recorder.last_eps
            recorder.last_eps = h["epsilon"]
        masked = wire["upload-bytes"]
        return {**h, **wire, **sent, **eps, "upload-mb": up / MB, "cumulative-upload-mb": recorder.cum_mb,
                "download-bytes": model_down, "download-mb": down / MB, "cumulative-download-mb": recorder.cum_down_mb,
                **recorder.totals(),
                "compression-ratio": h["dense-bytes"] / masked if masked else 0.0,
                "bits-per-parameter": 8 * masked / (h["num-replies"] * h["dimension"]),
                "modulus-bits": self.workflow.round_modulus_bits}

    def row_tail(self, rec: dict) -> str:
        bpp = rec.get("bits-per-parameter")
        return f" {'-' if bpp is None else f'{bpp:6.3f}':>6}"

    def after_round(self, recorder: RoundRecorder, server_round: int, arrays) -> None:
        """Nothing: the SecAgg+ path writes no checkpoint."""


def _warn_noise_room(ddp: DistributedDP) -> None:
    """Log, at start-up, the smallest SecAgg+ threshold whose noise shares ``secagg-clipping-range``
    holds (clients refuse rounds with a lower one, naming the range they need)."""
    t = ddp.min_threshold()
    if t > 2:
        log(WARNING, "fedcomp  dp = 'distributed': secagg-clipping-range = %g holds the clients' noise shares only for "
            "rounds whose SecAgg+ threshold is >= %d; clients refuse rounds with fewer (raise it for smaller rounds)",
            ddp.clipping_range, t)


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
    if note := secure_defaults_note(context.run_config):  # what secagg = true alone chose
        log(INFO, "fedcomp  %s", note)
    rounds = SecAggRounds(cfg, sa)
    recorder = RoundRecorder(cfg, rounds, out_dir, dict(resolve_secure_defaults(context.run_config)))
    initial = ndarrays_to_parameters([v.numpy().copy() for v in untie(recorder.model.state_dict()).values()])
    density = cfg.codec.density if cfg.codec.compressor == "randomk" else 1.0
    download = None
    if cfg.downstream != "none":  # SecAgg+ hides the updates; the global model can travel compressed
        sender = Downstream.for_run(cfg.codec, Download(cfg.downstream, density=cfg.downstream_density or None,
                                                        init=cfg.downstream_init))
        download = SecAggDownload(sender, recorder.keys)
        initial = download.start(initial)  # seeded where the first-contact policy says: what new nodes build
    inner = build_inner(cfg, legacy_evaluate_fn=recorder.legacy_evaluate, initial_parameters=initial)
    strategy = SharedRandomKStrategy(inner, density, rotation=sa.rotation,
                                     error_feedback=cfg.codec.error_feedback, seed=cfg.seed, keys=recorder.keys,
                                     pack=sa.pack, max_weight=sa.max_weight,
                                     client_dp=ClientLevelDP(cfg.clipping_norm, cfg.noise_multiplier, cfg.target_delta)
                                     if cfg.dp == "client-level" else None,
                                     distributed_dp=distributed_dp(cfg, sa),
                                     max_epsilon=cfg.max_epsilon or None, server_lr=sa.server_lr,
                                     server_lr_rounds=cfg.num_server_rounds if sa.server_lr_decay else 0)
    workflow = CompressedSecAggPlusWorkflow(sa.shares, sa.threshold, modulus_bits=sa.modulus_bits,
                                            max_weight=sa.max_weight, clipping_range=sa.clipping_range,
                                            quantization_range=sa.quantization_range, timeout=cfg.round_timeout,
                                            download=download, pack_protocol=sa.pack)
    rounds.strategy, rounds.workflow = strategy, workflow
    if strategy.distributed_dp is not None:
        _warn_noise_room(strategy.distributed_dp)
    log(INFO, "fedcomp  secure aggregation (Flower SecAgg+): %s, c = %g, Q = 2**%d, modulus %s, max-weight %g%s",
        strategy.describe(), sa.clipping_range, sa.quantization_bits,
        f"2**{sa.modulus_bits}" if sa.modulus_bits else "auto", sa.max_weight, ", packed" if sa.pack else "")
    legacy = LegacyContext(context, config=ServerConfig(num_rounds=cfg.num_server_rounds,
                                                        round_timeout=cfg.round_timeout), strategy=strategy)
    DefaultWorkflow(fit_workflow=workflow)(grid, legacy)
    if recorder.rounds:
        plot_rounds(recorder.rounds, out_dir / "plot.png", f"fedcomp: {strategy.describe()}")
        last = recorder.rounds[-1]
        log(INFO, "fedcomp  final accuracy %.4f after %d rounds, %.3f MB up and %.3f MB down on the wire (every "
            "SecAgg+ stage; the model %s), %.1fx fewer bytes than fp32 both ways", last["accuracy"], last["round"],
            recorder.cum_mb, recorder.cum_down_mb, "dense" if download is None else f"by {cfg.downstream}",
            last.get("cumulative-ratio-both-ways") or 0.0)
    log(INFO, "fedcomp  results written to %s (metrics.json, plot.png)", out_dir)
    if note := recorder.near_chance_note():  # the last line, where a user looks
        log(WARNING, "fedcomp  %s", note)
    return recorder.rounds
