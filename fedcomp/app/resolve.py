"""The reference app's run config resolved: every ``"auto"`` replaced by what it stands for, in one
ordered pass, and every check that spans several keys, once.

`resolve` takes the keys as parsed (each checked alone by its declaration, `fedcomp.app.keys`) and
settles the ``"auto"`` values in this order, each step a pure function of what the steps before it
settled:

1. ``strategy``: FedAvgM (server-lr 1.0, momentum 0.5) for STC/top-k below density 1/400 with classic
   error feedback and no DP, else FedAvg (`fedcomp.config.low_density.resolve_strategy`);
2. ``downstream``, ``downstream-density``: `resolve_downstream`;
3. ``downstream-init``: `resolve_init`;
4. ``downstream-correction``: `resolve_correction` ("on" or "off");

then refuses the combinations that cannot run (`check_combinations`). The codec keys resolve their own
``"auto"`` values where they are read (``density-schedule``, ``selection``, ``batchnorm-stats``:
`fedcomp.config.CodecConfig`), and ``secagg = true`` fills in the secure codec before parsing
(`fedcomp.config.secagg.resolve_secure_defaults`). ``metrics.json`` records what the strategy runs with
(``resolved``).

The download's defaults come from ``benchmarks/both_ways.py`` and ``benchmarks/llm_lora.py``
(docs/benchmarks/both-ways.md, llm.md): STC (Sattler et al., IEEE TNNLS 2019) at `AUTO_DENSITY` downward
with server-side error feedback for full-model training (a sparser download lags the global model);
``sign`` for LoRA adapters (every entry moves each round, so a client that missed rounds does not
drift); int8 under ``secagg`` (`AUTO_SECAGG_CODEC`, ``benchmarks/wire.py``); none with ``compressor =
"none"`` (the fp32 baseline stays fp32). The correction counts each update from the global model where
clients train with AdamW and the download is sparse (`fedcomp.download.correction`); never under
``secagg``, where the server sees only the masked sum.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fedcomp.app.keys import KEYS
from fedcomp.compression import CODECS
from fedcomp.config.codec import TENSOR_ONLY_CODECS
from fedcomp.config.low_density import check_ramp_direction, resolve_strategy
from fedcomp.download.correction import correction_refusal
from fedcomp.task.lora import LoraSettings

if TYPE_CHECKING:
    from fedcomp.app.config import AppConfig

#: Downstream codec and density "auto" chooses for full-model training.
AUTO_CODEC = "stc"
AUTO_DENSITY = 0.05
#: Downstream codec "auto" chooses for LoRA adapters.
AUTO_LORA_CODEC = "sign"
#: Downstream codec "auto" chooses under SecAgg+: its rotated shared random-k moves every entry of the
#: model a little each round, which a sparse or one-bit download follows with a lag that cost accuracy
#: (docs/benchmarks/wire.md).
AUTO_SECAGG_CODEC = "int8"
#: Client optimizers with which ``downstream-correction = "auto"`` turns the correction on (with a sparse
#: downstream codec): AdamW moves every weight by about ``lr`` a step, and its local training re-learns
#: what a sparse download left out; with SGD (the default CNN) the correction cost accuracy.
AUTO_CORRECTION_OPTIMIZERS = ("adamw",)


def resolve(cfg: AppConfig, run_config: Mapping[str, Any]) -> AppConfig:
    """``cfg`` (the keys as parsed) with every ``"auto"`` resolved and the combinations checked.

    Raises
    ------
    ValueError
        A combination of keys that cannot run, naming the keys.
    """
    strategy, server_lr, server_momentum = resolve_strategy(cfg.strategy, cfg.server_lr, cfg.server_momentum,
                                                            cfg.codec, cfg.dp)
    if cfg.strategy == "auto" and strategy != "fedavg":  # an explicit server-lr/-momentum is not overridden
        own = [f"'{k}' = {v!r}" for k, v in (("server-lr", cfg.server_lr), ("server-momentum", cfg.server_momentum))
               if v != KEYS[k].default]
        if own:
            raise ValueError(f"run config 'strategy' = 'auto' chooses {strategy} with server-lr {server_lr:g} and "
                             f"server-momentum {server_momentum:g} for this codec, but the run config sets "
                             f"{' and '.join(own)}: set 'strategy' = 'fedavgm' to use your values, or leave "
                             "server-lr and server-momentum at their defaults")
    cfg = replace(cfg, strategy=strategy, server_lr=server_lr, server_momentum=server_momentum)
    downstream, density = resolve_downstream(cfg.downstream, cfg.downstream_density, cfg.codec.compressor,
                                             cfg.finetune, KEYS["secagg"].read(run_config))
    cfg = replace(cfg, downstream=downstream, downstream_density=density)
    cfg = replace(cfg, downstream_init=resolve_init(cfg.downstream_init, cfg.finetune, cfg.resume))
    correction = resolve_correction(cfg.downstream_correction, cfg.downstream, cfg.optimizer, cfg.dp,
                                    cfg.codec.error_feedback, KEYS["secagg"].read(run_config))
    cfg = replace(cfg, downstream_correction="on" if correction else "off")
    check_combinations(cfg, run_config)
    return cfg


def resolve_downstream(requested: str, density: float, compressor: str, finetune: str,
                       secagg: bool) -> tuple[str, float]:
    """``(downstream codec, downstream density)`` for run config ``downstream`` = ``requested``:
    "auto" is "none" with ``compressor = "none"``, `AUTO_SECAGG_CODEC` with ``secagg`` (SecAgg+ hides the
    updates, not the global model: `fedcomp.download.secagg`), `AUTO_LORA_CODEC` for LoRA, else `AUTO_CODEC`
    at ``density`` or `AUTO_DENSITY`. ``density`` 0: the upload's (an explicit codec)."""
    if requested != "auto":
        return requested, density
    if compressor == "none":
        return "none", density
    if secagg:
        return AUTO_SECAGG_CODEC, density
    if finetune == "lora":
        return AUTO_LORA_CODEC, density
    return AUTO_CODEC, density or AUTO_DENSITY


def resolve_init(requested: str, finetune: str, resume: bool) -> str:
    """``downstream-init``: "auto" is "seeded" for a model trained from scratch (every float tensor drawn
    from a seed), and stays the library's "auto" for LoRA (the ServerApp draws the adapters' seeded start
    from the base model) and on resume (the model is trained: a compressed start)."""
    if requested == "auto" and finetune != "lora" and not resume:
        return "seeded"
    return requested


def resolve_correction(requested: str, downstream: str, optimizer: str, dp: str = "none",
                       error_feedback: bool | str = True, secagg: bool = False) -> float:
    """The correction ``c`` for run config ``downstream-correction`` = ``requested``: 1.0 (on) or 0.0 (off);
    "auto": on for a sparse downstream codec (``Compressor.sparse``: STC, top-k, rand-k, randsign) with an
    optimizer of `AUTO_CORRECTION_OPTIMIZERS`, off where it cannot apply (client-level DP, EF21, SecAgg+).

    Parameters
    ----------
    requested : {"auto", "on", "off"}
    downstream : str
        The resolved downstream codec ("none": dense).
    optimizer : str
        Run config ``optimizer`` of the clients.
    dp : str
        Run config ``dp``.
    error_feedback : bool or "ef21"
    secagg : bool
        Run config ``secagg``.
    """
    if requested != "auto":
        return 1.0 if requested == "on" else 0.0
    sparse = downstream != "none" and CODECS[downstream].sparse
    applies = dp != "client-level" and error_feedback != "ef21" and not secagg
    return 1.0 if sparse and applies and optimizer in AUTO_CORRECTION_OPTIMIZERS else 0.0


def check_combinations(cfg: AppConfig, run_config: Mapping[str, Any]) -> None:
    """Refuse the combinations of resolved keys that cannot run (each named with its keys).

    Raises
    ------
    ValueError
    """
    check_ramp_direction(cfg.codec)
    if cfg.codec.error_feedback == "ef21" and (cfg.fraction_train < 1.0 or cfg.client_sampling != "fraction"):
        raise ValueError("run config error-feedback = 'ef21' needs every client in every round: 'fraction-train' "
                         "= 1.0 and 'client-sampling' = 'fraction' (and 'min-train-nodes' = "
                         "'min-available-nodes' = all nodes); the server's single estimate h keeps a "
                         f"departed client's last h_i, got fraction-train = {cfg.fraction_train}, "
                         f"client-sampling = {cfg.client_sampling!r}")
    if cfg.downstream in TENSOR_ONLY_CODECS:
        raise ValueError(f"run config 'downstream' cannot be {cfg.downstream!r}: the server sends the model "
                         "change as one flat vector, which has no matrix to approximate")
    why = correction_refusal(1.0 if cfg.downstream_correction == "on" else 0.0, cfg.downstream != "none",
                             cfg.dp == "client-level", cfg.codec.error_feedback == "ef21", True)
    if why and not KEYS["secagg"].read(run_config):  # under secagg its own checks name the key
        raise ValueError(f"run config 'downstream-correction' = 'on' cannot apply: {why}")
    if cfg.local_clip_norm > 0 and cfg.dp == "dp-sgd":
        raise ValueError("run config 'local-clip-norm' must be 0 with dp = 'dp-sgd' (DP-SGD clips every "
                         "per-sample gradient to 'max-grad-norm' instead)")
    if cfg.dp == "dp-sgd" and (cfg.optimizer != "sgd" or cfg.precision != "fp32"):
        raise ValueError("run config dp = 'dp-sgd' trains with optimizer = 'sgd' and precision = 'fp32'")
    if (cfg.dataset == "shakespeare") != (cfg.model == "transformer"):
        raise ValueError("run config dataset = 'shakespeare' goes with model = 'transformer' (and only it), "
                         f"got dataset = {cfg.dataset!r}, model = {cfg.model!r}")
    if cfg.finetune == "lora":
        LoraSettings.from_mapping(run_config)  # base-model, lora-r, lora-alpha, lora-targets, ... (naming the key)
        if cfg.dataset != "shakespeare":
            raise ValueError("run config finetune = 'lora' fine-tunes a causal LM on text: dataset = 'shakespeare'")
        if cfg.dp == "dp-sgd" or cfg.resume:
            raise ValueError("run config finetune = 'lora' works without dp = 'dp-sgd' and resume = true (not yet)")


__all__ = ["AUTO_CODEC", "AUTO_CORRECTION_OPTIMIZERS", "AUTO_DENSITY", "AUTO_LORA_CODEC", "AUTO_SECAGG_CODEC",
           "check_combinations",
           "resolve", "resolve_correction", "resolve_downstream", "resolve_init"]
