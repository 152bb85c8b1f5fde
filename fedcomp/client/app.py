"""The fedcomp ClientApp: local SGD on this node's partition; updates leave compressed.

Mods: ``compression_mod`` is the first (outermost) mod, so any Flower DP mod added per
handler (``@app.train(mods=[fixedclipping_mod])``) sees dense weights.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from ..config import AppConfig
from ..data import DataConfig, load_partition
from ..models import build_model
from .mod import compression_mod
from .training import TrainConfig, evaluate, pick_device, train

app = ClientApp(mods=[compression_mod])


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
    data = load_partition(data_cfg, pid, nparts)
    model = build_model(cfg.model, tuple(data.tensors[0].shape[1:]))
    return cfg, device, data, model, pid


@app.train()
def train_handler(msg: Message, context: Context) -> Message:
    """Load the global weights, train ``local-epochs`` on the local partition, return weights.

    Reply: ArrayRecord ``arrays`` (the trained state dict, original names) and MetricRecord
    ``metrics`` with ``num-examples``, ``train-loss`` and ``train-seconds``.
    """
    import time

    cfg, device, data, model, pid = _setup(context)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    rnd = int(msg.content["config"].get("server-round", 0)) if "config" in msg.content else 0
    tcfg = TrainConfig(cfg.local_epochs, cfg.batch_size, cfg.accumulation_steps, cfg.lr, cfg.momentum)
    t0 = time.perf_counter()
    loss, n = train(model, data, tcfg, device, seed=cfg.seed * 100_003 + rnd * 1009 + pid)
    metrics = {"num-examples": n, "train-loss": float(loss), "train-seconds": time.perf_counter() - t0}
    content = RecordDict({"arrays": ArrayRecord(model.cpu().state_dict()), "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate_handler(msg: Message, context: Context) -> Message:
    """Evaluate the received global weights on the local partition (``eval-loss``, ``eval-acc``)."""
    _, device, data, model, _ = _setup(context)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    loss, acc = evaluate(model, data, device)
    metrics = MetricRecord({"num-examples": len(data), "eval-loss": float(loss), "eval-acc": float(acc)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
