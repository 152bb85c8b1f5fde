"""Shared pieces of the legacy-API tests: a tiny NumPyClient and in-process client proxies."""

from __future__ import annotations

import numpy as np
from flwr.client import NumPyClient
from flwr.common import (
    Code,
    DisconnectRes,
    EvaluateRes,
    GetParametersRes,
    GetPropertiesRes,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server import SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import FedAdam, FedAvg, FedProx

SIZES = (10, 20, 30)  # examples per client: unequal, so weighting matters


def init_weights(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((5, 3)).astype(np.float32), rng.standard_normal(3).astype(np.float32)]


class LinRegClient(NumPyClient):
    """Least squares on synthetic data, a few full-batch gradient steps per fit (deterministic)."""

    def __init__(self, cid: int, n: int | None = None, steps: int = 3, lr: float = 0.1) -> None:
        rng = np.random.default_rng(100 + cid)
        n = n or SIZES[cid % len(SIZES)]
        self.x = rng.standard_normal((n, 5)).astype(np.float32)
        true_w = rng.standard_normal((5, 3)).astype(np.float32)
        self.y = self.x @ true_w + 0.5
        self.steps, self.lr = steps, lr

    def _loss(self, w, b) -> float:
        return float(((self.x @ w + b - self.y) ** 2).mean())

    def fit(self, parameters, config):
        w, b = (np.array(p, dtype=np.float32) for p in parameters)
        for _ in range(self.steps):
            err = self.x @ w + b - self.y
            w = w - self.lr * (2 / err.size) * self.x.T @ err
            b = b - self.lr * (2 / err.size) * err.sum(0)
        return [w.astype(np.float32), b.astype(np.float32)], len(self.x), {"train-loss": self._loss(w, b)}

    def evaluate(self, parameters, config):
        w, b = parameters
        return self._loss(w, b), len(self.x), {}


class NumPyProxy(ClientProxy):
    """A ClientProxy that calls a NumPyClient in this process, through Flower's own
    NumPyClient -> Client adapter (so Parameters are serialized as on the wire)."""

    def __init__(self, cid: str, client: NumPyClient) -> None:
        super().__init__(cid)
        self.client = client

    def get_properties(self, ins, timeout, group_id):
        return GetPropertiesRes(Status(Code.OK, ""), {})

    def get_parameters(self, ins, timeout, group_id):
        return GetParametersRes(Status(Code.OK, ""), ndarrays_to_parameters([]))

    def fit(self, ins, timeout, group_id):
        return self.client.to_client().fit(ins)

    def evaluate(self, ins, timeout, group_id) -> EvaluateRes:
        return self.client.to_client().evaluate(ins)

    def reconnect(self, ins, timeout, group_id):
        return DisconnectRes("")


N = 3  #: clients in a legacy round


def make_inner(name: str):
    """Flower's legacy FedAvg, FedProx or FedAdam that fits all N clients from ``init_weights()``."""
    common = {"fraction_fit": 1.0, "fraction_evaluate": 0.0, "min_fit_clients": N, "min_available_clients": N,
              "initial_parameters": ndarrays_to_parameters(init_weights())}
    return {
        "fedavg": lambda: FedAvg(**common),
        "fedprox": lambda: FedProx(**common, proximal_mu=0.1),
        "fedadam": lambda: FedAdam(**common, eta=0.05, eta_l=0.1),
    }[name]()


def manager(clients) -> SimpleClientManager:
    """A client manager holding ``clients`` behind in-process proxies (cids "0", "1", ...)."""
    cm = SimpleClientManager()
    for i, c in enumerate(clients):
        cm.register(NumPyProxy(str(i), c))
    return cm


def fit_all(strategy, rnd, params, cm, *, corrupt_cid=None):
    """One round of ``fit`` on every proxy ``strategy`` configures: [(proxy, FitRes)]; the payload of
    ``corrupt_cid``'s reply has its magic broken."""
    results = []
    for proxy, ins in strategy.configure_fit(rnd, params, cm):
        res = proxy.fit(ins, None, rnd)
        if proxy.cid == corrupt_cid:
            arrays = parameters_to_ndarrays(res.parameters)
            arrays[0] = arrays[0].copy()
            arrays[0][:4] = 0  # break the payload's magic
            res.parameters = ndarrays_to_parameters(arrays)
        results.append((proxy, res))
    return results
