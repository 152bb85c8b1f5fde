"""Everything the reference app's ServerApp and ClientApp read from the run config (`AppConfig`):
federation, training, data, privacy mode and results settings, each read and checked by its one
declaration (`fedcomp.app.keys.KEYS`), and the combinations that cannot run refused
before anything starts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from fedcomp.app.keys import KEYS, check_known_keys
from fedcomp.app.resolve import resolve
from fedcomp.config.codec import CodecConfig
from fedcomp.config.secagg import SecAggConfig, resolve_secure_defaults
from fedcomp.privacy.settings import DP_MODES


def _default(key: str) -> Any:
    return KEYS[key].default


@dataclass(frozen=True)
class AppConfig:
    """Everything the ServerApp and ClientApp read from the run config; each field is the key of
    the same name in kebab case (``num_server_rounds``: ``num-server-rounds``), its default the
    key's declared default.

    With ``secagg = true`` and ``compressor`` at its default, the codec keys are those of
    `fedcomp.config.secagg.secure_defaults`.

    Every ``"auto"`` of the app's keys (``strategy``, ``downstream``, ``downstream-init``,
    ``downstream-correction``) is resolved when parsing, in one ordered pass (`fedcomp.app.resolve`).
    """

    num_server_rounds: int = _default("num-server-rounds")
    fraction_train: float = _default("fraction-train")
    fraction_evaluate: float = _default("fraction-evaluate")
    min_train_nodes: int = _default("min-train-nodes")
    min_available_nodes: int = _default("min-available-nodes")
    strategy: str = _default("strategy")
    server_lr: float = _default("server-lr")
    server_momentum: float = _default("server-momentum")
    lr: float = _default("lr")
    momentum: float = _default("momentum")
    local_epochs: int = _default("local-epochs")
    batch_size: int = _default("batch-size")
    accumulation_steps: int = _default("accumulation-steps")
    seed: int = _default("seed")
    dataset: str = _default("dataset")
    model: str = _default("model")
    partitioner: str = _default("partitioner")
    dirichlet_alpha: float = _default("dirichlet-alpha")
    results_dir: str = _default("results-dir")
    round_timeout: float = _default("round-timeout")
    resume: bool = _default("resume")
    client_sampling: str = _default("client-sampling")
    uplink_mbps: float = _default("uplink-mbps")
    downlink_mbps: float = _default("downlink-mbps")
    client_state_dir: str = _default("client-state-dir")
    verbose: bool = _default("verbose")
    downstream: str = _default("downstream")
    downstream_density: float = _default("downstream-density")
    downstream_init: str = _default("downstream-init")
    downstream_correction: str = _default("downstream-correction")
    dp: str = _default("dp")
    clipping_norm: float = _default("clipping-norm")
    noise_multiplier: float = _default("noise-multiplier")
    target_delta: float = _default("target-delta")
    max_epsilon: float = _default("max-epsilon")
    require_compression: bool = _default("require-compression")
    local_clip_norm: float = _default("local-clip-norm")
    optimizer: str = _default("optimizer")
    adam_beta1: float = _default("adam-beta1")
    adam_beta2: float = _default("adam-beta2")
    weight_decay: float = _default("weight-decay")
    precision: str = _default("precision")
    finetune: str = _default("finetune")
    codec: CodecConfig = field(default_factory=CodecConfig)

    @classmethod
    def from_run_config(cls, cfg: Mapping[str, Any]) -> AppConfig:
        """Parse, resolve and validate a Flower run config (``context.run_config``).

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
        return resolve(out, cfg)  # every "auto" resolved, the combinations checked (fedcomp.app.resolve)


__all__ = ["DP_MODES", "AppConfig"]
