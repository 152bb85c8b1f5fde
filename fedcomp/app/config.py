"""Everything the reference app's ServerApp and ClientApp read from the run config (`AppConfig`):
federation, training, data, privacy mode and results settings, each read and checked by its one
declaration (`fedcomp.app.keys.KEYS`), and the combinations that cannot run refused
before anything starts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from fedcomp.app.keys import KEYS, check_known_keys
from fedcomp.config.codec import TENSOR_ONLY_CODECS, CodecConfig
from fedcomp.download.settings import resolve_downstream
from fedcomp.config.low_density import check_ramp_direction, resolve_strategy
from fedcomp.config.secagg import SecAggConfig, resolve_secure_defaults
from fedcomp.privacy.settings import DP_MODES
from fedcomp.task.lora import LoraSettings


def _d(key: str) -> Any:
    return KEYS[key].default


@dataclass(frozen=True)
class AppConfig:
    """Everything the ServerApp and ClientApp read from the run config; each field is the key of
    the same name in kebab case (``num_server_rounds``: ``num-server-rounds``), its default the
    key's declared default.

    With ``secagg = true`` and ``compressor`` at its default, the codec keys are those of
    `fedcomp.config.secagg.secure_defaults`.

    ``strategy`` "auto" (the default) is resolved when parsing: "fedavgm" with server learning rate
    1.0 and momentum 0.5 for stc/topk below density 1/400 with classic error feedback, no momentum
    correction and no DP, else "fedavg" (`fedcomp.config.low_density`).
    """

    num_server_rounds: int = _d("num-server-rounds")
    fraction_train: float = _d("fraction-train")
    fraction_evaluate: float = _d("fraction-evaluate")
    min_train_nodes: int = _d("min-train-nodes")
    min_available_nodes: int = _d("min-available-nodes")
    strategy: str = _d("strategy")
    server_lr: float = _d("server-lr")
    server_momentum: float = _d("server-momentum")
    lr: float = _d("lr")
    momentum: float = _d("momentum")
    local_epochs: int = _d("local-epochs")
    batch_size: int = _d("batch-size")
    accumulation_steps: int = _d("accumulation-steps")
    seed: int = _d("seed")
    dataset: str = _d("dataset")
    model: str = _d("model")
    partitioner: str = _d("partitioner")
    dirichlet_alpha: float = _d("dirichlet-alpha")
    results_dir: str = _d("results-dir")
    round_timeout: float = _d("round-timeout")
    resume: bool = _d("resume")
    client_sampling: str = _d("client-sampling")
    uplink_mbps: float = _d("uplink-mbps")
    downlink_mbps: float = _d("downlink-mbps")
    client_state_dir: str = _d("client-state-dir")
    verbose: bool = _d("verbose")
    downstream: str = _d("downstream")
    downstream_density: float = _d("downstream-density")
    downstream_init: str = _d("downstream-init")
    downstream_correction: str = _d("downstream-correction")
    dp: str = _d("dp")
    clipping_norm: float = _d("clipping-norm")
    noise_multiplier: float = _d("noise-multiplier")
    target_delta: float = _d("target-delta")
    max_epsilon: float = _d("max-epsilon")
    require_compression: bool = _d("require-compression")
    local_clip_norm: float = _d("local-clip-norm")
    optimizer: str = _d("optimizer")
    adam_beta1: float = _d("adam-beta1")
    adam_beta2: float = _d("adam-beta2")
    weight_decay: float = _d("weight-decay")
    precision: str = _d("precision")
    finetune: str = _d("finetune")
    codec: CodecConfig = field(default_factory=CodecConfig)

    @classmethod
    def from_run_config(cls, cfg: Mapping[str, Any]) -> AppConfig:
        """Parse and validate a Flower run config (``context.run_config``).

        Raises
        ------
        ValueError
            Naming the first bad key and its allowed range, or an unknown key with the closest
            valid name (`check_known_keys`).
        """
        check_known_keys(cfg)
        secagg = KEYS["secagg"].read(cfg)  # "true" or 1 would otherwise run silently WITHOUT secure aggregation
        if cfg.get("dp") == "distributed" and not secagg:
            raise ValueError("run config dp = 'distributed' needs secagg = true: the clients' noise shares only "
                             "add up to the intended noise inside SecAgg+'s masked sum (without secure aggregation "
                             "use dp = 'client-level' or 'local')")
        cfg = resolve_secure_defaults(cfg)  # secagg = true with the default compressor: the secure codec
        SecAggConfig.from_run_config(cfg)  # the secagg-* keys, named when bad, even with secagg = false
        out = cls(**{f.name: KEYS[f.name.replace("_", "-")].read(cfg) for f in fields(cls) if f.name != "codec"},
                  codec=CodecConfig.from_mapping(cfg))
        # "auto": FedAvgM for stc/topk below 1/400, else FedAvg (fedcomp.config.low_density)
        strategy, server_lr, server_momentum = resolve_strategy(out.strategy, out.server_lr, out.server_momentum,
                                                                out.codec, out.dp)
        if out.strategy == "auto" and strategy != "fedavg":  # an explicit server-lr/-momentum is not overridden
            own = [f"'{k}' = {v!r}" for k, v in (("server-lr", out.server_lr), ("server-momentum", out.server_momentum))
                   if v != KEYS[k].default]
            if own:
                raise ValueError(f"run config 'strategy' = 'auto' chooses {strategy} with server-lr {server_lr:g} and "
                                 f"server-momentum {server_momentum:g} for this codec, but the run config sets "
                                 f"{' and '.join(own)}: set 'strategy' = 'fedavgm' to use your values, or leave "
                                 "server-lr and server-momentum at their defaults")
        out = replace(out, strategy=strategy, server_lr=server_lr, server_momentum=server_momentum)
        # "auto": stc at 5 % (sign for LoRA) both ways; none with compressor none or secagg (fedcomp.download.settings)
        downstream, downstream_density = resolve_downstream(out.downstream, out.downstream_density,
                                                            out.codec.compressor, out.finetune,
                                                            KEYS["secagg"].read(cfg))
        out = replace(out, downstream=downstream, downstream_density=downstream_density)
        check_ramp_direction(out.codec)
        if out.codec.error_feedback == "ef21" and (out.fraction_train < 1.0 or out.client_sampling != "fraction"):
            raise ValueError("run config error-feedback = 'ef21' needs every client in every round: 'fraction-train' "
                             "= 1.0 and 'client-sampling' = 'fraction' (and 'min-train-nodes' = "
                             "'min-available-nodes' = all nodes); the server's single estimate h keeps a "
                             f"departed client's last h_i, got fraction-train = {out.fraction_train}, "
                             f"client-sampling = {out.client_sampling!r}")
        if out.downstream in TENSOR_ONLY_CODECS:
            raise ValueError(f"run config 'downstream' cannot be {out.downstream!r}: the server sends the model "
                             "change as one flat vector, which has no matrix to approximate")
        if out.local_clip_norm > 0 and out.dp == "dp-sgd":
            raise ValueError("run config 'local-clip-norm' must be 0 with dp = 'dp-sgd' (DP-SGD clips every "
                             "per-sample gradient to 'max-grad-norm' instead)")
        if out.dp == "dp-sgd" and (out.optimizer != "sgd" or out.precision != "fp32"):
            raise ValueError("run config dp = 'dp-sgd' trains with optimizer = 'sgd' and precision = 'fp32'")
        if (out.dataset == "shakespeare") != (out.model == "transformer"):
            raise ValueError("run config dataset = 'shakespeare' goes with model = 'transformer' (and only it), "
                             f"got dataset = {out.dataset!r}, model = {out.model!r}")
        if out.finetune == "lora":
            LoraSettings.from_mapping(cfg)  # base-model, lora-r, lora-alpha, lora-targets, ... (naming the key)
            if out.dataset != "shakespeare":
                raise ValueError("run config finetune = 'lora' fine-tunes a causal LM on text: dataset = 'shakespeare'")
            if out.dp == "dp-sgd" or out.resume:
                raise ValueError("run config finetune = 'lora' works without dp = 'dp-sgd' and resume = true (not yet)")
        return out


__all__ = ["DP_MODES", "AppConfig"]
