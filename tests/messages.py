"""Hand-built Flower messages for unit tests (Metadata given explicitly)."""

import itertools
import time

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, Metadata, MetricRecord, RecordDict

_ids = itertools.count(1)


def make_msg(content: RecordDict, message_type: str = "train", dst: int = 7) -> Message:
    md = Metadata(run_id=1, message_id=f"m{next(_ids)}", src_node_id=1, dst_node_id=dst, reply_to_message_id="",
                  group_id="1", created_at=time.time(), ttl=3600.0, message_type=message_type)
    return Message(content=content, metadata=md)


def make_ctx(node_config=None, run_config=None, node_id=7) -> Context:
    return Context(run_id=1, node_id=node_id,
                   node_config={"partition-id": 0, "num-partitions": 2, **(node_config or {})},
                   state=RecordDict(), run_config=dict(run_config or {}))


def weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(20, 10, generator=g).numpy(), "b": torch.randn(10, generator=g).numpy()}


def train_msg(global_w: dict, config: dict | None = None, dst: int = 7) -> Message:
    cfg = ConfigRecord({"server-round": 1, **(config or {})})
    return make_msg(RecordDict({"arrays": ArrayRecord({k: _arr(v) for k, v in global_w.items()}), "config": cfg}),
                    dst=dst)


def _arr(v):
    from flwr.app import Array

    return Array(np.array(v, copy=True, order="C"))


def reply_with(msg: Message, new_w: dict, n: int = 10, extra_metrics=None) -> Message:
    rec = ArrayRecord({k: _arr(v) for k, v in new_w.items()})
    m = MetricRecord({"num-examples": n, "train-loss": 0.5, **(extra_metrics or {})})
    return Message(content=RecordDict({"arrays": rec, "metrics": m}), reply_to=msg)
