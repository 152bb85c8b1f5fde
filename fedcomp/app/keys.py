"""The run-config keys of fedcomp's reference app: its own (federation, server strategy, local
training, data and model, results: `APP`), each declared once, and the registry of every key the
app reads: its own, the LoRA ones (`fedcomp.task.lora.LORA_KEYS`) and the library's (the codec's,
the privacy ones and SecAgg's, `fedcomp.config.keys.GROUPS`). Together they are exactly the keys
of ``[tool.flwr.app.config]`` in ``pyproject.toml``, with the same defaults (a test holds that).

`fedcomp.app.config.AppConfig` is filled from them. Local training's defaults are
`fedcomp.task.training.TrainConfig`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedcomp.compression import available_compressors
from fedcomp.config import keys as library
from fedcomp.privacy.settings import DP_KEYS
from fedcomp.protocol.messages import DEFAULT_DOWNLINK_MBPS, DEFAULT_UPLINK_MBPS, MIN_LINK_MBPS
from fedcomp.task.lora import LORA_KEYS
from fedcomp.task.training import TrainConfig
from fedcomp.util.declared_key import Key, table

_T = TrainConfig
#: Strategies the ServerApp builds; "auto" is resolved by `fedcomp.config.low_density.resolve_strategy`.
STRATEGIES = ("auto", "fedavg", "fedadam", "fedavgm")

APP = table(
    # federation
    Key("num-server-rounds", int, 50, "rounds of the run", lo=1),
    Key("fraction-train", float, 1.0, "fraction of the available nodes that train each round",
        lo=0.0, hi=1.0, lo_open=True),
    Key("fraction-evaluate", float, 0.5, "fraction of nodes that evaluate the global model on their own data "
        "each round (0 = off; off under dp)", lo=0.0, hi=1.0),
    Key("client-sampling", str, "fraction", "Flower's sampling of fraction-train, or Poisson: each node with "
        "probability fraction-train", choices=("fraction", "poisson")),
    Key("min-train-nodes", int, 2, "fewest nodes a round trains on", lo=1),
    Key("min-available-nodes", int, 2, "nodes the server waits for before the first round", lo=1),
    Key("round-timeout", float, 600.0, "seconds the server waits for a round's replies", lo=0.0, lo_open=True),
    # server strategy
    Key("strategy", str, "auto", "inner strategy; auto: fedavgm (server-lr 1.0, momentum 0.5) for stc/topk below "
        "density 1/400 with error feedback and no dp, else fedavg", choices=STRATEGIES),
    Key("server-lr", float, 0.1, "FedAdam's eta; FedAvgM's server learning rate", lo=0.0, lo_open=True),
    Key("server-momentum", float, 0.9, "FedAvgM's server momentum", lo=0.0, hi=1.0, hi_open=True),
    Key("downstream", str, "auto", "server-to-client compression: auto (stc at density 0.05; sign for LoRA; int8 "
        "with secagg; none with compressor none), none (dense) or any codec",
        choices=("auto",) + tuple(available_compressors())),
    Key("downstream-density", float, 0.0, "density of a sparse downstream codec (stc, topk, randomk); 0 = the "
        "upload's density", lo=0.0, hi=1.0),
    Key("downstream-init", str, "auto", "what a client that holds nothing gets first: auto (a seeded start for the "
        "model trained from scratch; on resume a compressed start with int8), seeded, dense, or a codec name (a "
        "compressed start with it)", choices=("auto", "seeded", "dense") + tuple(available_compressors())),
    Key("downstream-correction", str, "auto", "count each client's update from the global model, not from the "
        "compressed copy it trained from: on, off, or auto (on for optimizer adamw with a sparse downstream codec)",
        choices=("auto", "on", "off")),
    Key("uplink-mbps", float, DEFAULT_UPLINK_MBPS, "a client's default upload speed (node config overrides), "
        "for the simulated round time", lo=MIN_LINK_MBPS),
    Key("downlink-mbps", float, DEFAULT_DOWNLINK_MBPS, "a client's default download speed (node config "
        "overrides)", lo=MIN_LINK_MBPS),
    Key("require-compression", bool, False, "refuse dense replies (clients without compression_mod) instead "
        "of counting them"),
    # local training
    Key("lr", float, _T.lr, "client learning rate", lo=0.0, lo_open=True),
    Key("momentum", float, _T.momentum, "client SGD momentum", lo=0.0, hi=1.0, hi_open=True),
    Key("local-epochs", int, _T.local_epochs, "epochs over the local partition per round", lo=1),
    Key("batch-size", int, _T.batch_size, "examples per local step", lo=1),
    Key("accumulation-steps", int, _T.accumulation_steps, "local steps whose gradients are summed before one "
        "optimizer step", lo=1),
    Key("local-clip-norm", float, _T.local_clip_norm, "DGC local gradient clipping: max L2 norm of each local "
        "step's gradient; 0 = off", lo=0.0),
    Key("optimizer", str, _T.optimizer, "sgd (lr, momentum) or adamw (lr, adam-beta1, adam-beta2)",
        choices=("sgd", "adamw")),
    Key("adam-beta1", float, _T.beta1, "AdamW's beta1", lo=0.0, hi=1.0, hi_open=True),
    Key("adam-beta2", float, _T.beta2, "AdamW's beta2", lo=0.0, hi=1.0, hi_open=True),
    Key("weight-decay", float, _T.weight_decay, "AdamW's decoupled weight decay / SGD's L2 penalty", lo=0.0),
    Key("precision", str, _T.precision, "bf16: autocast forward (fp32 weights, updates and residuals)",
        choices=("fp32", "bf16")),
    Key("seed", int, 42, "seed of data partitioning, model initialisation and local training", lo=0, hi=2**31 - 1),
    # data and model
    Key("dataset", str, "digits", "sklearn digits (offline), shakespeare (LEAF, one client per role) or a "
        "Hugging Face dataset name"),
    Key("model", str, "cnn", "cnn / resnet (8x8 digits), mlp, transformer (shakespeare)",
        choices=("cnn", "mlp", "resnet", "transformer")),
    Key("partitioner", str, "dirichlet", "how the data is split across clients", choices=("iid", "dirichlet")),
    Key("dirichlet-alpha", float, 0.5, "label skew of the dirichlet partitioner (smaller: more skewed)",
        lo=0.0, lo_open=True),
    # results
    Key("results-dir", str, "", "where metrics.json, plot.png and checkpoints go; empty: "
        "~/fedcomp-results/<timestamp>-<compressor>"),
    Key("resume", bool, False, "continue the run in results-dir from its last checkpoint"),
    Key("client-state-dir", str, "", "clients persist their error-feedback residual here (node config "
        "state-dir wins)"),
    Key("verbose", bool, False, "Flower's own per-round lines on the console too (always in flower.log)"),
)

#: Every run-config key of the app by group, in the reference table's order.
GROUPS: dict[str, dict[str, Key]] = {"app": APP, "codec": library.GROUPS["codec"], "dp": library.GROUPS["dp"],
                                     "lora": LORA_KEYS, "secagg": library.GROUPS["secagg"]}
#: ``{name: Key}`` of every run-config key (a name declared in two groups is refused at import).
KEYS: dict[str, Key] = table(*(k for group in GROUPS.values() for k in group.values()))

#: Run-config keys the app's ServerApp and ClientApp read besides the codec keys, the ``secagg*`` keys
#: and the LoRA keys: the app's and the privacy keys.
APP_KEYS: tuple[str, ...] = (*APP, *DP_KEYS)


def run_config_keys() -> frozenset[str]:
    """Every run-config key the app knows (the names of `KEYS`)."""
    return frozenset(KEYS)


def check_known_keys(cfg: Mapping[str, Any], known: frozenset[str] | None = None, source: str = "run config") -> None:
    """`fedcomp.config.keys.check_known_keys` against every key of the app (`run_config_keys`)
    unless ``known`` is given.

    Raises
    ------
    ValueError
        ``run config key 'densty' is unknown; did you mean 'density'?`` (the first unknown key in sorted order).
    """
    library.check_known_keys(cfg, run_config_keys() if known is None else known, source)


def reference_table(keys: Mapping[str, Key] | None = None) -> str:
    """`fedcomp.config.keys.reference_table` of ``keys``, by default every key of the app (`KEYS`)."""
    return library.reference_table(KEYS if keys is None else keys)


__all__ = ["APP", "APP_KEYS", "GROUPS", "KEYS", "STRATEGIES", "check_known_keys", "reference_table", "run_config_keys"]
