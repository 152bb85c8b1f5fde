"""The fedcomp ClientApp: local SGD on this node's partition; updates leave compressed.

Mods: ``compression_mod`` is the outermost mod of plain messages, so any Flower DP mod added per
handler (``@app.train(mods=[fixedclipping_mod])``) sees dense weights. ``secagg_mod`` in front
of it handles only Flower SecAgg+ messages (run config ``secagg = true``, see ``fedcomp.secagg``).
"""

from __future__ import annotations

import json
import os
import pathlib

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from ..config import AppConfig
from ..data import DataConfig, load_partition
from ..datafiles import DATA_FILE_KEY, load_partition_file
from ..device import CLIENT_INFO_KEY, client_info
from ..lora import LoraSettings, load_weights, lora_model, weights_record
from ..models import build_model
from ..protocol import server_round
from ..secagg.client import secagg_mod
from .mod import _state_file, compression_mod
from .training import TrainConfig, evaluate, pick_device, train

#: Key in ``context.state`` of the DP-SGD accountant's history (a MetricRecord of float lists).
DP_ACCOUNTANT_KEY = "fedcomp.dp-accountant"

app = ClientApp(mods=[secagg_mod, compression_mod])  # secagg_mod: only Flower SecAgg+ messages (secagg = true)


def _setup(context: Context):
    cfg = AppConfig.from_run_config(context.run_config)
    node = context.node_config
    threads = node.get("num-threads")
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"node config 'num-threads' must be an integer >= 1, got {threads!r}")
        torch.set_num_threads(threads)
    device = pick_device(str(node.get("device", "auto")))
    try:
        pid, nparts = int(node["partition-id"]), int(node["num-partitions"])
    except KeyError as exc:
        raise ValueError(f"node config needs 'partition-id' and 'num-partitions' (missing {exc})") from None
    data_cfg = DataConfig(cfg.dataset, cfg.partitioner, cfg.dirichlet_alpha, cfg.seed)
    data_file = node.get(DATA_FILE_KEY)  # a device's own partition file: no data extra needed
    data = (load_partition_file(str(data_file), data_cfg, pid, nparts) if data_file
            else load_partition(data_cfg, pid, nparts))
    if cfg.finetune == "lora":  # the frozen base (loaded once per process) with peft adapters
        model = lora_model(LoraSettings.from_mapping(context.run_config), device)
    else:
        model = build_model(cfg.model, tuple(data.tensors[0].shape[1:]))
    return cfg, device, data, model, pid


def _accountant_file(context: Context) -> pathlib.Path | None:
    """``<state dir>/accountant-<partition>.json`` next to the residual file, if a state dir is set."""
    residual = _state_file(context)
    return None if residual is None else residual.with_name(residual.name.replace("residual-", "accountant-")
                                                                          .replace(".npz", ".json"))


def _load_accountant(path: pathlib.Path) -> dict:
    """A persisted DP-SGD accountant history; an unreadable one stops training (epsilon must never
    silently restart from zero).

    Raises
    ------
    ValueError
        The file is not a JSON object of equal-length number lists.
    """
    try:
        state = json.loads(path.read_text())
        lists = [state[k] for k in ("noise-multiplier", "sample-rate", "steps")]
        ok = all(isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
                 for v in lists) and len({len(v) for v in lists}) == 1
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"privacy accountant file {path} is unreadable ({exc}); refusing to train") from None
    if not ok:
        raise ValueError(f"privacy accountant file {path} is malformed; refusing to train")
    return state


@app.train()
def train_handler(msg: Message, context: Context) -> Message:
    """Load the global weights, train ``local-epochs`` on the local partition, return weights.

    Reply: ArrayRecord ``arrays`` (the trained state dict, original names) and MetricRecord
    ``metrics`` with ``num-examples``, ``train-loss`` and ``train-seconds``; with
    ``dp = "dp-sgd"`` training runs under Opacus and ``epsilon`` (cumulative, at
    ``target-delta``; inf without noise) is added.
    """
    import time

    cfg, device, data, model, pid = _setup(context)
    load_weights(model, msg.content["arrays"], cfg.finetune == "lora")
    rnd = server_round(msg)
    tcfg = TrainConfig(cfg.local_epochs, cfg.batch_size, cfg.accumulation_steps, cfg.lr, cfg.momentum,
                       cfg.local_clip_norm, optimizer=cfg.optimizer, beta1=cfg.adam_beta1, beta2=cfg.adam_beta2,
                       weight_decay=cfg.weight_decay, precision=cfg.precision)
    seed = cfg.seed * 100_003 + rnd * 1009 + pid
    t0 = time.perf_counter()
    extra = {}
    if cfg.dp == "dp-sgd":
        # imported here: Opacus calls logging.basicConfig at import (every log line would print twice)
        from .dp_sgd import DPSGDConfig, projected_epsilon, train_dp_sgd

        # One accountant per client for the whole run: its history lives in context.state.
        dp_cfg = DPSGDConfig.from_mapping(context.run_config)
        acc_file = _accountant_file(context)
        prev = dict(context.state[DP_ACCOUNTANT_KEY]) if DP_ACCOUNTANT_KEY in context.state else None
        if prev is None and acc_file is not None and acc_file.exists():
            prev = _load_accountant(acc_file)
        if cfg.max_epsilon and projected_epsilon(dp_cfg, tcfg, len(data), prev) > cfg.max_epsilon:
            raise ValueError(f"privacy budget: this round would raise this client's epsilon past max-epsilon "
                             f"{cfg.max_epsilon}; the client does not train")
        loss, n, eps, state = train_dp_sgd(model, data, tcfg, dp_cfg, device, seed=seed, accountant_state=prev)
        context.state[DP_ACCOUNTANT_KEY] = MetricRecord(state)
        if acc_file is not None:
            acc_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = acc_file.with_name(acc_file.name + ".tmp")
            tmp.write_text(json.dumps(state))
            os.replace(tmp, acc_file)
        extra["epsilon"] = float(eps)
        extra["epsilon-next"] = float(projected_epsilon(dp_cfg, tcfg, len(data), state))
    else:
        loss, n = train(model, data, tcfg, device, seed=seed)
    metrics = {"num-examples": n, "train-loss": float(loss), "train-seconds": time.perf_counter() - t0, **extra}
    content = RecordDict({"arrays": weights_record(model, cfg.finetune == "lora"), "metrics": MetricRecord(metrics),
                          CLIENT_INFO_KEY: client_info()})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate_handler(msg: Message, context: Context) -> Message:
    """Evaluate the received global weights on the local partition (``eval-loss``, ``eval-acc``)."""
    cfg, device, data, model, _ = _setup(context)
    load_weights(model, msg.content["arrays"], cfg.finetune == "lora")
    loss, acc = evaluate(model, data, device)
    metrics = MetricRecord({"num-examples": len(data), "eval-loss": float(loss), "eval-acc": float(acc)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
