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
)
from flwr.server.client_proxy import ClientProxy

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
