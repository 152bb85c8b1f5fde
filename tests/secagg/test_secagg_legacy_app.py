"""The recipe for an existing Flower SecAgg+ app (NumPyClient + SecAggPlusWorkflow): add
``shared_randomk_mod`` after ``secaggplus_mod`` and wrap the strategy; Flower's own workflow unchanged."""

import numpy as np
from flwr.app import Context, RecordDict
from flwr.client import NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import ndarrays_to_parameters
from flwr.server import LegacyContext, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

from fedcomp.secagg import SharedRandomKStrategy, shared_randomk_mod
from fedcomp.secagg.encoding import SharedProjection, flower_weight, quantization_bound, round_seed
from fedcomp.run.inprocess_grid import InProcessGrid

from .helpers import client_delta, global_model, num_examples


class Client(NumPyClient):
    def __init__(self, pid):
        self.pid = pid

    def fit(self, parameters, config):
        d = client_delta(self.pid)
        return [p + d[k] for p, k in zip(parameters, ("w", "b", "steps"))], num_examples(self.pid), {"train-loss": 1.0}


def test_existing_numpyclient_secaggplus_app_with_the_two_changes():
    app = ClientApp(client_fn=lambda ctx: Client(int(ctx.node_config["partition-id"])).to_client(),
                    mods=[secaggplus_mod, shared_randomk_mod])
    n, density = 3, 0.25
    g = global_model()
    captured = {}

    def evaluate_fn(rnd, arrays, config):
        captured[rnd] = arrays
        return 0.0, {}

    fedavg = FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=n, min_available_clients=n,
                    evaluate_fn=evaluate_fn, initial_parameters=ndarrays_to_parameters(list(g.values())))
    strategy = SharedRandomKStrategy(fedavg, density, seed=3)
    ctx = LegacyContext(Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                        config=ServerConfig(num_rounds=1), strategy=strategy)
    DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(num_shares=1.0, reconstruction_threshold=0.7))(
        InProcessGrid(app, n, {}), ctx)
    proj = SharedProjection(2050, density, round_seed(3, 1))
    w = [flower_weight(num_examples(p), 1000.0, 1 << 22) for p in range(n)]  # Flower's defaults: Q = 2**22
    flat = [np.concatenate([client_delta(p)["w"].reshape(-1), client_delta(p)["b"]]) for p in range(n)]
    plain = sum(wi * f[proj.positions()] for wi, f in zip(w, flat)) / sum(w)
    new = captured[1]
    got = np.concatenate([(new[0] - g["w"]).reshape(-1), new[1] - g["b"]]).astype(np.float64)[proj.positions()]
    assert np.abs(got - plain).max() <= quantization_bound(w, 8.0, 1 << 22) + 1e-6  # Flower's c = 8
    assert strategy.history[1]["num-replies"] == n and strategy.history[1]["k"] == 512
