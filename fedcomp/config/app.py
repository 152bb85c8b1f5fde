"""Everything fedcomp's ServerApp and ClientApp read from the run config (:class:`AppConfig`):
federation, training, data, privacy mode and results settings, each with its one default, checked
for type and range, and the combinations that cannot run refused before anything starts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from fedcomp.compression import available_compressors
from fedcomp.config.low_density import check_ramp_direction, resolve_strategy
from fedcomp.protocol.messages import DEFAULT_DOWNLINK_MBPS, DEFAULT_UPLINK_MBPS, MIN_LINK_MBPS
from fedcomp.task.training import TrainConfig
from fedcomp.util.validate import read_bool, read_number, read_string
from fedcomp.config.codec import TENSOR_ONLY_CODECS, CodecConfig
from fedcomp.config.keys import check_known_keys

#: ``dp`` modes: none; sample-level DP-SGD on clients (Opacus); client-level DP-FedAvg on the
#: server; local clip + noise of each update on the client before compression.
DP_MODES = ("none", "dp-sgd", "client-level", "local")


@dataclass(frozen=True)
class AppConfig:
    """Everything the ServerApp and ClientApp read from the run config.

    ``strategy`` "auto" (the default) is resolved when parsing: "fedavgm" with server learning rate
    1.0 and momentum 0.5 for stc/topk below density 1/400 with classic error feedback, no momentum
    correction and no DP, else "fedavg" (:mod:`fedcomp.config.low_density`, measured in issue 25).
    """

    num_server_rounds: int = 50
    fraction_train: float = 1.0
    fraction_evaluate: float = 0.5
    min_train_nodes: int = 2
    min_available_nodes: int = 2
    strategy: str = "auto"
    server_lr: float = 0.1
    server_momentum: float = 0.9
    lr: float = TrainConfig.lr
    momentum: float = TrainConfig.momentum
    local_epochs: int = TrainConfig.local_epochs
    batch_size: int = TrainConfig.batch_size
    accumulation_steps: int = TrainConfig.accumulation_steps
    seed: int = 42
    dataset: str = "digits"
    model: str = "cnn"
    partitioner: str = "dirichlet"
    dirichlet_alpha: float = 0.5
    results_dir: str = ""
    round_timeout: float = 600.0
    resume: bool = False
    client_sampling: str = "fraction"
    uplink_mbps: float = DEFAULT_UPLINK_MBPS
    downlink_mbps: float = DEFAULT_DOWNLINK_MBPS
    client_state_dir: str = ""
    verbose: bool = False
    downstream: str = "none"
    dp: str = "none"
    clipping_norm: float = 1.0
    noise_multiplier: float = 1.0
    target_delta: float = 1e-5
    max_epsilon: float = 0.0
    require_compression: bool = False
    local_clip_norm: float = TrainConfig.local_clip_norm
    optimizer: str = TrainConfig.optimizer
    adam_beta1: float = TrainConfig.beta1
    adam_beta2: float = TrainConfig.beta2
    weight_decay: float = TrainConfig.weight_decay
    precision: str = TrainConfig.precision
    finetune: str = "full"
    codec: CodecConfig = field(default_factory=CodecConfig)

    @classmethod
    def from_run_config(cls, cfg: Mapping[str, Any]) -> AppConfig:
        """Parse and validate a Flower run config (``context.run_config``).

        Raises
        ------
        ValueError
            Naming the first bad key and its allowed range, or an unknown key with the closest
            valid name (:func:`check_known_keys`).
        """
        check_known_keys(cfg)
        read_bool(cfg, "secagg", False)  # "true" or 1 would otherwise run silently WITHOUT secure aggregation
        d = {f.name: f.default for f in fields(cls)}
        out = cls(
            num_server_rounds=read_number(cfg, "num-server-rounds", d["num_server_rounds"], lo=1, integer=True),
            fraction_train=read_number(cfg, "fraction-train", d["fraction_train"], lo=0.0, hi=1.0, lo_open=True),
            fraction_evaluate=read_number(cfg, "fraction-evaluate", d["fraction_evaluate"], lo=0.0, hi=1.0),
            min_train_nodes=read_number(cfg, "min-train-nodes", d["min_train_nodes"], lo=1, integer=True),
            min_available_nodes=read_number(cfg, "min-available-nodes", d["min_available_nodes"], lo=1, integer=True),
            strategy=read_string(cfg, "strategy", d["strategy"], ("auto", "fedavg", "fedadam", "fedavgm")),
            server_momentum=read_number(cfg, "server-momentum", d["server_momentum"], lo=0.0, hi=1.0, hi_open=True),
            server_lr=read_number(cfg, "server-lr", d["server_lr"], lo=0.0, lo_open=True),
            lr=read_number(cfg, "lr", d["lr"], lo=0.0, lo_open=True),
            momentum=read_number(cfg, "momentum", d["momentum"], lo=0.0, hi=1.0, hi_open=True),
            local_epochs=read_number(cfg, "local-epochs", d["local_epochs"], lo=1, integer=True),
            batch_size=read_number(cfg, "batch-size", d["batch_size"], lo=1, integer=True),
            accumulation_steps=read_number(cfg, "accumulation-steps", d["accumulation_steps"], lo=1, integer=True),
            seed=read_number(cfg, "seed", d["seed"], lo=0, hi=2**31 - 1, integer=True),
            dataset=read_string(cfg, "dataset", d["dataset"]),
            model=read_string(cfg, "model", d["model"], ("cnn", "mlp", "resnet", "transformer")),
            partitioner=read_string(cfg, "partitioner", d["partitioner"], ("iid", "dirichlet")),
            dirichlet_alpha=read_number(cfg, "dirichlet-alpha", d["dirichlet_alpha"], lo=0.0, lo_open=True),
            results_dir=read_string(cfg, "results-dir", d["results_dir"]),
            round_timeout=read_number(cfg, "round-timeout", d["round_timeout"], lo=0.0, lo_open=True),
            resume=read_bool(cfg, "resume", d["resume"]),
            client_sampling=read_string(cfg, "client-sampling", d["client_sampling"], ("fraction", "poisson")),
            uplink_mbps=read_number(cfg, "uplink-mbps", d["uplink_mbps"], lo=MIN_LINK_MBPS),
            downlink_mbps=read_number(cfg, "downlink-mbps", d["downlink_mbps"], lo=MIN_LINK_MBPS),
            client_state_dir=read_string(cfg, "client-state-dir", d["client_state_dir"]),
            verbose=read_bool(cfg, "verbose", d["verbose"]),
            downstream=read_string(cfg, "downstream", d["downstream"], tuple(available_compressors())),
            dp=read_string(cfg, "dp", d["dp"], DP_MODES),
            clipping_norm=read_number(cfg, "clipping-norm", d["clipping_norm"], lo=0.0, lo_open=True),
            noise_multiplier=read_number(cfg, "noise-multiplier", d["noise_multiplier"], lo=0.0),
            target_delta=read_number(cfg, "target-delta", d["target_delta"], lo=0.0, hi=1.0, lo_open=True, hi_open=True),
            max_epsilon=read_number(cfg, "max-epsilon", d["max_epsilon"], lo=0.0),
            require_compression=read_bool(cfg, "require-compression", d["require_compression"]),
            local_clip_norm=read_number(cfg, "local-clip-norm", d["local_clip_norm"], lo=0.0),
            optimizer=read_string(cfg, "optimizer", d["optimizer"], ("sgd", "adamw")),
            adam_beta1=read_number(cfg, "adam-beta1", d["adam_beta1"], lo=0.0, hi=1.0, hi_open=True),
            adam_beta2=read_number(cfg, "adam-beta2", d["adam_beta2"], lo=0.0, hi=1.0, hi_open=True),
            weight_decay=read_number(cfg, "weight-decay", d["weight_decay"], lo=0.0),
            precision=read_string(cfg, "precision", d["precision"], ("fp32", "bf16")),
            finetune=read_string(cfg, "finetune", d["finetune"], ("full", "lora")),
            codec=CodecConfig.from_mapping(cfg),
        )
        # "auto": FedAvgM for stc/topk below 1/400, else FedAvg (fedcomp.config.low_density)
        strategy, server_lr, server_momentum = resolve_strategy(out.strategy, out.server_lr, out.server_momentum,
                                                                out.codec, out.dp)
        out = replace(out, strategy=strategy, server_lr=server_lr, server_momentum=server_momentum)
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
            from fedcomp.task.lora import LoraSettings

            LoraSettings.from_mapping(cfg)  # base-model, lora-r, lora-alpha, lora-targets, ... (naming the key)
            if out.dataset != "shakespeare":
                raise ValueError("run config finetune = 'lora' fine-tunes a causal LM on text: dataset = 'shakespeare'")
            if out.dp == "dp-sgd" or out.resume:
                raise ValueError("run config finetune = 'lora' works without dp = 'dp-sgd' and resume = true (not yet)")
        return out


__all__ = ["DP_MODES", "AppConfig"]
