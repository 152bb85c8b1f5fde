"""The train request a client reads from the server's config and its own node config: a node may switch
classic error feedback off, but not against EF21 (whose server estimate needs every client's h_i)."""

import pytest
from flwr.app import ArrayRecord, ConfigRecord, RecordDict


@pytest.mark.parametrize("server_ef,node_ef", [("ef21", True), ("ef21", False), (True, "ef21")])
def test_node_config_cannot_switch_error_feedback_against_ef21(server_ef, node_ef):
    from flwr.serverapp.strategy import FedAvg

    from fedcomp.app.client_app import app as client_app
    from fedcomp.task.models import build_model
    from fedcomp.run.inprocess_grid import InProcessGrid
    from fedcomp.strategies import CompressedStrategy
    grid = InProcessGrid(client_app, 2, {"lr": 0.05}, node_configs=[{"error-feedback": node_ef}] * 2)
    s = CompressedStrategy(FedAvg(min_available_nodes=2, fraction_evaluate=0.0), compressor="topk", density=0.1,
                           error_feedback=server_ef)
    msgs = list(s.configure_train(1, ArrayRecord(build_model().state_dict()), ConfigRecord({"seed": 1}), grid))
    replies = grid.send_and_receive(msgs)
    assert all(r.has_error() for r in replies)
    assert "error-feedback" in replies[0].error.reason


def test_node_config_may_still_switch_classic_error_feedback():
    from flwr.app import Context

    from fedcomp.client.request import _codec
    ctx = Context(run_id=1, node_id=1, node_config={"error-feedback": False}, state=RecordDict(), run_config={})
    assert _codec({"compressor": "topk", "error-feedback": True}, ctx).error_feedback is False
