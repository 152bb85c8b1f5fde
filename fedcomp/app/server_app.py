"""The fedcomp ServerApp: run config -> CompressedStrategy(inner).start(...) -> table, files."""

from __future__ import annotations

import dataclasses
from logging import INFO, WARNING

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fedcomp.app import checkpoint
from fedcomp.app.console import quiet_known_noise, route_flower_logs
from fedcomp.app.data_record import check_same_data
from fedcomp.app.inner import build_inner
from fedcomp.app.recorder import CompressedRounds, RoundRecorder, privacy_settings, privacy_statement
from fedcomp.app.results import plot_rounds
from fedcomp.app.secagg_server_app import check_secagg_config, distributed_dp, run_secagg, secagg_requested
from fedcomp.app.startup import (
    RunConfigError,
    check_supernodes_fit_the_data,
    one_line_config_errors,
    writable_results_dir,
)
from fedcomp.app.strategy_record import check_same_strategy
from fedcomp.app.config import AppConfig
from fedcomp.config import CODEC_DEFAULTS
from fedcomp.config.low_density import auto_note, resolve_schedule, short_ramp_note
from fedcomp.privacy import ClientLevelDP, DPSGDConfig, LocalDP, check_accountable
from fedcomp.statedict import copy_array, to_record, untie
from fedcomp.strategies import Admission, CompressedStrategy, Download, PoissonSampling, Privacy
from fedcomp.strategies.offset import RoundOffset
from fedcomp.task.data import DataConfig
from fedcomp.task.lora import LoraSettings, initial_adapters, weights_record
from fedcomp.task.models import build_model

app = ServerApp()


def concern_options(cfg: AppConfig, context: Context | None = None) -> dict:
    """``CompressedStrategy`` keyword arguments for the run config's concerns: ``downstream`` (a
    `Download` from ``downstream``, ``downstream-density``, ``downstream-init``, ``downstream-correction``),
    ``privacy`` (run config ``dp``, ``max-epsilon``; validated at start-up), ``sampling``
    (``client-sampling``) and ``admission`` (``require-compression``).

    Raises
    ------
    ValueError
        A DP key out of range, or (dp-sgd) an infeasible ``target-epsilon`` / ``secure-rng``; a downstream
        correction that cannot apply.
    """
    correction = 1.0 if cfg.downstream_correction == "on" else 0.0
    opts: dict = {"downstream": Download(cfg.downstream, density=cfg.downstream_density or None,
                                         init=cfg.downstream_init, correction=correction),
                  "admission": Admission(require_compression=cfg.require_compression)}
    q = None
    if cfg.client_sampling == "poisson":
        q = cfg.fraction_train
        # The sample must be secret for amplification by sampling: OS entropy, not the run seed.
        opts["sampling"] = PoissonSampling(q, seed=None)
    client_dp = local_dp = None
    if cfg.dp == "client-level":
        client_dp = ClientLevelDP(cfg.clipping_norm, cfg.noise_multiplier, cfg.target_delta,  # CSPRNG noise
                                  sample_rate=q or 1.0)
    elif cfg.dp == "local":
        local_dp = LocalDP(cfg.clipping_norm, cfg.noise_multiplier, cfg.target_delta)
    if cfg.dp in ("client-level", "local"):  # the accountant must be able to compute epsilon, every round
        check_accountable(cfg.noise_multiplier, cfg.target_delta, q or 1.0)
    if context is not None and cfg.dp == "dp-sgd":
        DPSGDConfig.from_mapping(context.run_config)
    if cfg.max_epsilon and cfg.dp == "none":
        log(WARNING, "fedcomp  max-epsilon = %s has no effect with dp = 'none'", cfg.max_epsilon)
    opts["privacy"] = Privacy(client_dp, local_dp, cfg.max_epsilon or None)
    return opts


def check_same_codec(saved: dict | None, cfg: AppConfig) -> None:
    """Refuse a resume whose codec keys differ from the checkpoint's, naming each one.

    Refused rather than allowed with a warning: the clients' saved error-feedback residuals are
    what *that* codec (and selection scope) failed to send, so another codec drops or misreads
    them, and ``metrics.json`` records one codec for all its rounds. A run that should change
    codec starts as a new run in a new ``results-dir``. A key the checkpoint does not hold (added
    to fedcomp after it was written) counts as its default, which is what that run used; a
    checkpoint's ``batchnorm-stats = "small"`` resumes under "auto".

    Raises
    ------
    ValueError
        Naming every codec key whose value differs, with both values.
    """
    if saved is None:
        return
    now = cfg.codec.to_mapping()
    # A key the checkpoint lacks is newer than the checkpoint: that run used the key's default.
    saved = {**{k: v for k, v in CODEC_DEFAULTS.items() if k not in saved}, **saved}
    if saved.get("density-schedule") == "auto":  # a default "auto" resolves from the checkpoint's own codec
        saved["density-schedule"] = resolve_schedule("auto", saved.get("compressor"), saved.get("density", 1.0),
                                                     saved.get("error-feedback"), saved.get("warmup-rounds", 0))
    if saved.get("batchnorm-stats") == "small" and now.get("batchnorm-stats") == "auto":
        # the default before "auto": exact statistics left no residual to misread, so the run may go on with "auto"
        saved["batchnorm-stats"] = "auto"
    ramps = ("exponential", "linear")
    # the ramp's keys do nothing while neither schedule ramps (a changed default must not block a resume)
    unused = () if now.get("density-schedule") in ramps or saved.get("density-schedule") in ramps \
        else ("density-start", "schedule-rounds")
    diff = [f"'{k}' = {now.get(k)!r} (checkpoint: {saved.get(k)!r})" for k in sorted(set(now) | set(saved))
            if now.get(k) != saved.get(k) and k not in unused]
    if diff:
        raise ValueError("run config 'resume': the codec settings differ from the checkpoint's: " + ", ".join(diff)
                         + ". The clients' error-feedback residuals and the codec recorded for past rounds belong "
                         "to the checkpoint's codec: resume with the same settings, or start a new run (another "
                         "'results-dir') to change the codec")


def _resume(cfg: AppConfig, out_dir, strategy: CompressedStrategy, recorder: RoundRecorder, model):
    """Load the checkpoint in ``out_dir`` for run config ``resume``: (round, initial ArrayRecord).

    Raises
    ------
    ValueError
        No ``results-dir``, dp-sgd or EF21 without ``client-state-dir``, a bad checkpoint, or privacy or
        codec settings that differ from the checkpoint's.
    FileNotFoundError
        No checkpoint in ``out_dir``.
    """
    if not cfg.results_dir:
        raise ValueError("run config 'resume' = true needs 'results-dir' set to the folder of the run to resume")
    if cfg.codec.error_feedback == "ef21" and not cfg.client_state_dir:
        raise ValueError("run config 'resume' with error-feedback = 'ef21' needs 'client-state-dir': the server's "
                         "estimate h (in the checkpoint) is the mean of the clients' h_i, which they keep there")
    if cfg.dp == "dp-sgd" and not cfg.client_state_dir:
        raise ValueError("run config 'resume' with dp = 'dp-sgd' needs 'client-state-dir': clients keep their "
                         "privacy accountants there, otherwise epsilon would restart from zero")
    offset, weights, meta = checkpoint.load(out_dir, strategy,
                                            {k: tuple(v.shape) for k, v in untie(model.state_dict()).items()})
    saved = meta.get("extra", {}).get("privacy-settings")
    if saved is not None and saved != privacy_settings(cfg):
        raise ValueError(f"run config 'resume': the privacy settings differ from the checkpoint's ({saved} vs "
                         f"{privacy_settings(cfg)}); epsilon cannot be accounted across a change")
    check_same_codec(meta.get("extra", {}).get("codec-settings"), cfg)
    check_same_strategy(meta, cfg, strategy, str(out_dir))
    check_same_data(meta, cfg)
    initial = ArrayRecord({k: Array(copy_array(v)) for k, v in weights.items()})
    recorder.restore(meta)
    log(INFO, "fedcomp  resuming %s after round %d", out_dir, offset)
    return offset, initial


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the federation described by the run config and write ``metrics.json`` and ``plot.png``."""
    quiet_known_noise()
    one_line_config_errors()
    try:
        cfg = AppConfig.from_run_config(context.run_config)
        if secagg_requested(context.run_config):  # Flower SecAgg+ (legacy workflow), fedcomp.secagg: first, so
            # that a setting it does not support is named as such (not by what it makes downstream resolve to)
            distributed_dp(cfg, check_secagg_config(context.run_config))  # its keys too, before anything starts
        options = concern_options(cfg, context)
    except ValueError as err:
        raise RunConfigError(str(err)) from err
    check_supernodes_fit_the_data(len(list(grid.get_node_ids())),
                                  DataConfig(cfg.dataset, cfg.partitioner, cfg.dirichlet_alpha, cfg.seed))
    torch.manual_seed(cfg.seed)
    out_dir = writable_results_dir(cfg.results_dir, cfg.codec.compressor)
    route_flower_logs(out_dir, cfg.verbose)
    if note := auto_note(context.run_config, cfg):  # once per run: what the "auto" defaults chose
        log(INFO, "fedcomp  %s", note)
    if note := short_ramp_note(cfg):
        log(WARNING, "fedcomp  %s", note)
    if context.run_config.get("downstream-correction", "auto") == "auto" and options["downstream"].correction:
        log(INFO, "fedcomp  downstream-correction 'auto' chose on (optimizer %r, downstream %s): each update is "
            "counted from the global model, not the client's compressed copy; set it to \"off\" to fold them as "
            "they came", cfg.optimizer, options["downstream"].codec)
    if secagg_requested(context.run_config):
        run_secagg(grid, context, cfg, out_dir)
        return
    adapters = None
    if cfg.finetune == "lora":  # LoRA's seeded start, from the base model's config (no weights)
        adapters, seeded = initial_adapters(LoraSettings.from_mapping(context.run_config), cfg.seed)
        if cfg.downstream_init == "auto":  # an explicit downstream-init ("dense", a codec) stays in force
            options["downstream"] = dataclasses.replace(options["downstream"], init=seeded)
    strategy = CompressedStrategy.from_codec_config(build_inner(cfg), cfg.codec, **options)
    recorder = RoundRecorder(cfg, CompressedRounds(cfg, strategy, dict(context.run_config)), out_dir,
                             dict(context.run_config))
    train_config = ConfigRecord({"seed": cfg.seed})
    if adapters is not None:
        model, initial, offset = None, to_record(adapters), 0
    else:
        model = build_model(cfg.model, tuple(recorder.test.tensors[0].shape[1:]))
        initial, offset = weights_record(model, lora=False), 0  # tied parameters once
    if cfg.resume:
        try:
            offset, initial = _resume(cfg, out_dir, strategy, recorder, model)
        except (ValueError, FileNotFoundError) as err:  # one line naming the keys, not a traceback
            raise RunConfigError(str(err)) from err
    remaining = cfg.num_server_rounds - offset
    if remaining <= 0:
        log(WARNING, "fedcomp  nothing to do: the checkpoint is at round %d and num-server-rounds = %d",
            offset, cfg.num_server_rounds)
    else:
        runner = RoundOffset(strategy, offset) if offset else strategy

        def evaluate_fn(rnd: int, arrays: ArrayRecord):
            return None if (offset and rnd == 0) else recorder(rnd + offset, arrays)

        runner.start(grid=grid, initial_arrays=initial, num_rounds=remaining, timeout=cfg.round_timeout,
                     train_config=train_config, evaluate_fn=evaluate_fn)
    plot_rounds(recorder.rounds, out_dir / "plot.png", f"fedcomp: {strategy.codec.describe()}")
    last = recorder.rounds[-1]
    ratio = recorder.totals()["cumulative-ratio-both-ways"]
    log(INFO, "fedcomp  final accuracy %.4f after %d rounds, %.3f MB uploaded and %.3f MB downloaded in total%s",
        last["accuracy"], last["round"], recorder.cum_mb, recorder.cum_down_mb,
        f" ({ratio:.0f}x fewer bytes than fp32 both ways)" if ratio else "")
    if strategy.stopped_reason:
        log(INFO, "fedcomp  stopped early: %s", strategy.stopped_reason)
    log(INFO, "fedcomp  results written to %s (metrics.json, plot.png)", out_dir)
    if note := recorder.near_chance_note():  # the last line, where a user looks
        log(WARNING, "fedcomp  %s", note)


__all__ = ["RoundRecorder", "app", "build_inner", "check_same_codec", "concern_options", "main", "privacy_settings",
           "privacy_statement"]
