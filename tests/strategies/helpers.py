"""Plain helpers for the strategy tests: an inner FedAvg that needs one node, a reply that went
through ``compression_mod``, and the strategy remembering the global model of a round."""

from flwr.app import Message
from flwr.serverapp.strategy import FedAvg

from fedcomp.client import compression_mod
from fedcomp.statedict import FlatModel
from tests.messages import make_ctx, reply_with, train_msg


def fedavg() -> FedAvg:
    """Flower's FedAvg that trains with one node and evaluates nothing."""
    return FedAvg(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1)


def compressed_reply(global_w: dict, trained_w: dict, node: int = 7, codec: dict | None = None, n: int = 10,
                     metrics: dict | None = None) -> Message:
    """Node ``node``'s reply to a train message with ``global_w``: ``trained_w`` compressed by the mod
    (``codec``, default ``{"compressor": "none"}``), ``n`` examples, extra ``metrics``."""
    msg = train_msg(global_w, codec or {"compressor": "none"}, dst=node)
    return compression_mod(msg, make_ctx(node_id=node),
                           lambda m, c: reply_with(m, trained_w, n=n, extra_metrics=metrics))


def setup(strategy, global_w: dict, rnd: int = 1) -> None:
    """What ``configure_train`` remembers of round ``rnd`` (the global model), without sampling nodes."""
    strategy.remember(rnd, FlatModel.from_numpy(global_w))
