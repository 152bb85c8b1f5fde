"""The fedcomp ClientApp: local SGD on this node's partition; updates leave compressed.

Mods: ``compression_mod`` is the outermost mod of plain messages, so any Flower DP mod added per
handler (``@app.train(mods=[fixedclipping_mod])``) sees dense weights. ``secagg_mod`` in front
of it handles only Flower SecAgg+ messages (run config ``secagg = true``, see ``fedcomp.secagg``).
"""

from __future__ import annotations

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedcomp.client.mod import compression_mod
from fedcomp.client.state import accountant_of, keep_accountant, state_files
from fedcomp.app.config import AppConfig
from fedcomp.privacy import DPSGDConfig, logical_batch_size, projected_epsilon
from fedcomp.protocol.device import CLIENT_INFO_KEY, client_info
from fedcomp.protocol.messages import server_round
from fedcomp.secagg.client import secagg_mod
from fedcomp.task.data import DataConfig
from fedcomp.task.datafiles import DATA_FILE_KEY, cached_partition, load_partition_file
from fedcomp.task.lora import LoraSettings, load_weights, lora_model, weights_record
from fedcomp.task.models import build_model
from fedcomp.task.training import TrainConfig, evaluate, pick_device, train

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
            else cached_partition(data_cfg, pid, nparts))  # computed once per node, then read from the cache
    if cfg.finetune == "lora":  # the frozen base (loaded once per process) with peft adapters
        model = lora_model(LoraSettings.from_mapping(context.run_config), device)
    else:
        model = build_model(cfg.model, tuple(data.tensors[0].shape[1:]))
    return cfg, device, data, model, pid


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
    if not len(data):  # one line in the server's log, not a traceback from the training loop
        raise ValueError(f"partition-id {pid} of {context.node_config['num-partitions']} holds no training "
                         "example: nothing to train on (more SuperNodes than the data fills?)")
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
        from fedcomp.privacy.dp_sgd import train_dp_sgd

        # One accountant per client for the whole run: its history lives in context.state.
        dp_cfg = DPSGDConfig.from_mapping(context.run_config)
        files = state_files(context)
        prev = accountant_of(context, files)
        steps = {"logical_batch": logical_batch_size(tcfg.batch_size, tcfg.accumulation_steps),
                 "local_epochs": tcfg.local_epochs}
        if cfg.max_epsilon and projected_epsilon(dp_cfg, len(data), prev, **steps) > cfg.max_epsilon:
            raise ValueError(f"privacy budget: this round would raise this client's epsilon past max-epsilon "
                             f"{cfg.max_epsilon}; the client does not train")
        loss, n, eps, state = train_dp_sgd(model, data, dp_cfg, device, lr=tcfg.lr, momentum=tcfg.momentum,
                                           batch_size=tcfg.batch_size, accumulation_steps=tcfg.accumulation_steps,
                                           local_epochs=tcfg.local_epochs, seed=seed, accountant_state=prev)
        keep_accountant(context, files, state)
        extra["epsilon"] = float(eps)
        extra["epsilon-next"] = float(projected_epsilon(dp_cfg, len(data), state, **steps))
    else:
        loss, n = train(model, data, tcfg, device, seed=seed)
    metrics = {"num-examples": n, "train-loss": float(loss), "train-seconds": time.perf_counter() - t0, **extra}
    content = RecordDict({"arrays": weights_record(model, cfg.finetune == "lora"), "metrics": MetricRecord(metrics)})
    if CLIENT_INFO_KEY not in context.state:  # the node's machine, once a run: the server remembers it
        content[CLIENT_INFO_KEY] = context.state[CLIENT_INFO_KEY] = client_info()
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate_handler(msg: Message, context: Context) -> Message:
    """Evaluate the received global weights on the local partition (``eval-loss``, ``eval-acc``)."""
    cfg, device, data, model, _ = _setup(context)
    load_weights(model, msg.content["arrays"], cfg.finetune == "lora")
    # an empty local partition reports 0 examples (weight 0 in the server's weighted mean)
    loss, acc = evaluate(model, data, device) if len(data) else (0.0, 0.0)
    metrics = MetricRecord({"num-examples": len(data), "eval-loss": float(loss), "eval-acc": float(acc)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
