"""The client enforces its own local-DP floor, and one client's
epsilon report cannot stop the federation."""

import logging

import numpy as np
import pytest
from flwr.app import ArrayRecord
from flwr.serverapp.strategy import FedAvg

import fedcomp.compression as fc
from fedcomp.client import compression_mod
from fedcomp.strategies import CompressedStrategy, Privacy
from tests.messages import make_ctx, reply_with, train_msg, weights

logging.getLogger("flwr").setLevel(logging.WARNING)
FLOOR = {"dp": "local", "noise-multiplier": 1.0, "clipping-norm": 1.0}


def _train(server_cfg: dict, node_cfg: dict):
    called = []
    g, t = weights(0), weights(1)

    def handler(m, c):
        called.append(1)
        return reply_with(m, t)

    msg = train_msg(g, {"compressor": "none", "error-feedback": False, **server_cfg})
    reply = compression_mod(msg, make_ctx(node_config=node_cfg), handler)
    return reply, called, g, t


@pytest.mark.parametrize("server_cfg", [{}, {"local-dp-clipping-norm": 1.0, "local-dp-noise-multiplier": 0.0},
                                        {"local-dp-clipping-norm": 1.0, "local-dp-noise-multiplier": 0.5}])
def test_client_refuses_to_train_below_its_own_noise_floor(server_cfg):
    with pytest.raises(ValueError, match="privacy floor"):
        _train(server_cfg, FLOOR)


def test_client_applies_the_servers_stronger_setting():
    reply, called, g, t = _train({"local-dp-clipping-norm": 0.5, "local-dp-noise-multiplier": 2.0}, FLOOR)
    assert called == [1]
    sent = np.concatenate([fc.decompress(reply.content["arrays"][k].data).numpy().ravel() for k in g])
    raw = np.concatenate([(t[k] - g[k]).ravel() for k in g])
    noise = sent - raw * min(1.0, 0.5 / float(np.linalg.norm(raw)))
    assert float(np.std(noise)) == pytest.approx(2.0 * 0.5, rel=0.15)  # z * C of the server's request


def test_without_a_floor_the_server_decides():
    reply, called, g, t = _train({}, {})
    assert called == [1]
    assert np.array_equal(fc.decompress(reply.content["arrays"]["w"].data).numpy(), t["w"] - g["w"])


def _reply(node: int, eps_next: float, g: dict):
    msg = train_msg(g, {"compressor": "none", "error-feedback": False}, dst=node)
    reply = compression_mod(msg, make_ctx(node_id=node), lambda m, c: reply_with(
        m, {k: v + 0.01 for k, v in g.items()}, extra_metrics={"epsilon": eps_next / 2, "epsilon-next": eps_next}))
    return reply


class _Grid:
    def get_node_ids(self):
        return [1, 2]

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        from tests.messages import make_msg

        return make_msg(content, message_type, dst_node_id)


def test_one_huge_epsilon_report_does_not_stop_the_federation():
    from fedcomp.run.inprocess_grid import _ensure_task_identity

    _ensure_task_identity()
    g = weights(0)
    s = CompressedStrategy(FedAvg(fraction_evaluate=0.0, min_available_nodes=2, min_train_nodes=2),
                           compressor="none", error_feedback=False, privacy=Privacy(max_epsilon=5.0))
    arrays = ArrayRecord({k: reply_with(train_msg(g), g).content["arrays"][k] for k in g})
    from flwr.app import ConfigRecord

    assert list(s.configure_train(1, arrays, ConfigRecord({}), _Grid()))
    s.aggregate_train(1, [_reply(1, 1e9, g), _reply(2, 1.0, g)])  # node 1's report is unverifiable
    assert list(s.configure_train(2, arrays, ConfigRecord({}), _Grid())), "one report stopped everyone"
    assert s.stopped_reason == ""
    s.aggregate_train(2, [_reply(1, 1e9, g), _reply(2, 7.0, g)])  # now even the lowest exceeds the budget
    assert list(s.configure_train(3, arrays, ConfigRecord({}), _Grid())) == []
    assert "max-epsilon" in s.stopped_reason
