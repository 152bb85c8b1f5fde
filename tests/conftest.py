"""Fixtures shared by the test packages (plain helper functions for hand-built Flower messages
are in ``tests/messages.py``)."""

import pytest
from flwr.app import Context, RecordDict


@pytest.fixture
def run_server_app():
    """Run fedcomp's ServerApp on a fresh in-process grid: ``run_server_app(run_config, nodes=2)``
    (fresh SuperNodes, so an empty ``context.state``, as after a restart)."""
    from fedcomp.client.app import app as client_app
    from fedcomp.server.app import main
    from fedcomp.simulation import InProcessGrid

    def run(run_config: dict, nodes: int = 2) -> None:
        ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=run_config)
        main(InProcessGrid(client_app, nodes, run_config), ctx)

    return run
