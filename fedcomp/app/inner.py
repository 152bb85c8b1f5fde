"""The inner Flower strategy both ServerApps wrap, from run config ``strategy``.

The plain path wraps a Message-API strategy (``flwr.serverapp.strategy``) in
[`fedcomp.strategies.CompressedStrategy`][]; the SecAgg+ path needs a legacy one
(``flwr.server.strategy``: Flower 1.42 runs SecAgg+ only in the legacy ``DefaultWorkflow``) inside
`fedcomp.secagg.SharedRandomKStrategy`. FedAdam and FedAvgM take the same settings in both APIs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flwr.common import Parameters
from flwr.server import strategy as legacy_api
from flwr.serverapp import strategy as message_api

from fedcomp.app.config import AppConfig


def build_inner(cfg: AppConfig, *, legacy_evaluate_fn: Callable | None = None,
                initial_parameters: Parameters | None = None) -> Any:
    """The inner Flower strategy named by run config ``strategy``: "fedavg", "fedadam" (eta =
    ``server-lr``) or "fedavgm" (server learning rate ``server-lr``, momentum ``server-momentum``).

    Message API (default): the global model is evaluated on the server's test split every round
    (``evaluate_fn`` of ``start``) and, with ``fraction-evaluate`` > 0, by that fraction of the nodes
    on their own data (federated evaluation, as Flower's templates do; at least one node). Under
    ``dp`` federated evaluation is off: per-client accuracies on private data are not covered by the
    privacy guarantee. Poisson client sampling asks the inner strategy for every node (the wrapper
    samples).

    Parameters
    ----------
    cfg : AppConfig
        The run config.
    legacy_evaluate_fn : callable, optional
        Given: a legacy strategy (``flwr.server.strategy``) evaluated centrally only, by this
        ``evaluate_fn(server_round, ndarrays, config)`` (``fraction_evaluate = 0``), failures accepted.
    initial_parameters : flwr.common.Parameters, optional
        The legacy strategy's initial model (with ``legacy_evaluate_fn``).
    """
    api = message_api if legacy_evaluate_fn is None else legacy_api
    if legacy_evaluate_fn is not None:
        common: dict = {"fraction_fit": cfg.fraction_train, "fraction_evaluate": 0.0,
                        "min_fit_clients": cfg.min_train_nodes, "min_evaluate_clients": 0,
                        "min_available_clients": cfg.min_available_nodes, "evaluate_fn": legacy_evaluate_fn,
                        "initial_parameters": initial_parameters, "accept_failures": True}
    else:
        fraction_evaluate = cfg.fraction_evaluate if cfg.dp == "none" else 0.0
        common = {"fraction_train": 1.0 if cfg.client_sampling == "poisson" else cfg.fraction_train,
                  "fraction_evaluate": fraction_evaluate, "min_train_nodes": cfg.min_train_nodes,
                  "min_evaluate_nodes": 1 if fraction_evaluate > 0 else 0,
                  "min_available_nodes": cfg.min_available_nodes}
    if cfg.strategy == "fedadam":
        return api.FedAdam(**common, eta=cfg.server_lr, eta_l=cfg.lr)
    if cfg.strategy == "fedavgm":
        return api.FedAvgM(**common, server_learning_rate=cfg.server_lr, server_momentum=cfg.server_momentum)
    return api.FedAvg(**common)


__all__ = ["build_inner"]
