"""``SharedRandomKStrategy``: a legacy Flower strategy wrapper for shared-seed random-k under SecAgg+.

Flower 1.42 runs SecAgg+ only in the legacy ``DefaultWorkflow`` with a ``flwr.server.strategy``
strategy. This wrapper adds one concern to an inner legacy strategy (``FedAvg``, ``FedAvgM``,
``FedAdam``, ...): each round it sends a shared seed (and ``density``, the rotation flag) in the
fit config, and when ``SecAggPlusWorkflow`` hands over the unmasked weighted mean of the k
encoded values it scatters them into the round's shared positions, undoes the rotation, adds the
mean update to the global model and lets the inner strategy apply that model as its aggregate.

FedAvg weighting is SecAgg+'s: each client's vector is multiplied by
``w_i = round(num_examples_i / max_weight * Q) / Q`` inside ``secaggplus_mod`` and the workflow
divides the unmasked sum by ``sum(w_i)``: the result is the num-examples-weighted mean (weights
rounded to 1/Q of ``max_weight``). The inner strategy gets one FitRes with those weights and
``num_examples = sum(num_examples_i)``: FedAvg returns it unchanged, FedAvgM / FedAdam treat
``global - it`` as their pseudo-gradient. Integer and bool tensors keep the global values; BatchNorm
``*running_var`` tensors (named through ``keys``) are clamped at 0 (SecAgg+'s stochastic
quantization can push a small variance below 0).
"""

from __future__ import annotations

from logging import ERROR, WARNING

import numpy as np
from flwr.common import (
    Code,
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    Parameters,
    Scalar,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.logger import log
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from fedcomp.download.shared_step import SharedStep
from fedcomp.privacy import ClientLevelDP
from fedcomp.privacy.accounting import checked_max_epsilon
from fedcomp.privacy.distributed import DistributedDP
from fedcomp.protocol.messages import (
    SECAGG_APPLIED_KEY,
    SECAGG_DDP_NOISE_KEY,
    SECAGG_DP_CLIP_KEY,
    SECAGG_KEYS_KEY,
    SECAGG_PACK_KEY,
    SECAGG_ROTATION_KEY,
    SECAGG_SEED_KEY,
)
from fedcomp.secagg.encoding import SharedProjection, round_seed
from fedcomp.strategies.privacy_budget import over_budget
from fedcomp.strategies.round_metrics import reported_number


class SharedRandomKStrategy(Strategy):
    """Shared-seed random-k (optionally rotated) updates through SecAgg+, around a legacy strategy.

    Parameters
    ----------
    strategy : flwr.server.strategy.Strategy
        The inner legacy strategy (sampling, evaluation, server optimiser).
    density : float
        Fraction of the float entries every client sends, in (0, 1]; 1.0 with ``rotation=False``
        is dense SecAgg+ (every entry, same quantization).
    rotation : bool
        Shared randomised Hadamard rotation before the selection (default False).
    error_feedback : bool
        Clients keep what they did not send (default True; Stich et al. 2018).
    seed : int
        Run seed; round r's shared seed is derived from it and r (not a secret: it only names
        positions and rotation, which every client learns anyway).
    keys : list of str, optional
        Parameter names in model order: sent to the clients so that a Message-API train handler
        (fedcomp's ClientApp) gets named arrays; omit for legacy (NumPyClient) apps.
    pack : bool
        Tell clients the server unpacks packed masked vectors (needs
        `fedcomp.secagg.CompressedSecAggPlusWorkflow`, which sets ``unpacking_workflow``;
        with another workflow ``configure_fit`` raises, naming the mismatch); default False.
    client_dp : fedcomp.privacy.ClientLevelDP, optional
        Client-level DP: clients clip their k values to ``clipping_norm`` with uniform weights
        (needs ``error_feedback=False``); the server divides the unmasked sum by the number of
        clients sampled and adds Gaussian noise of std ``noise_multiplier * clipping_norm / clients``
        (OS CSPRNG) to the k values, accounted by RDP per round (McMahan et al. 2018, DP-FedAvg).
        The server sees the exact sum before adding the noise: the guarantee holds for whoever sees
        the released models (clients, the public), with an honest server.
    distributed_dp : fedcomp.privacy.distributed.DistributedDP, optional
        Distributed DP (needs ``error_feedback=False``, not with ``client_dp``): clients clip their k
        values to its ``clipping_norm`` with uniform weights and add their shares of Skellam noise
        (sized by the round's SecAgg+ threshold, which
        `fedcomp.secagg.CompressedSecAggPlusWorkflow` sets in `round_threshold`); the
        server divides the unmasked sum by the number of clients sampled, adds nothing, and accounts
        the round with the number of clients whose noise is in the sum (Agarwal et al. 2021).
    max_weight : float, optional
        SecAgg+'s ``max_weight`` (run config ``secagg-max-weight``): a round in which any client
        reports ``num_examples`` outside ``[1, max_weight]`` is refused (the masked sum is already
        scaled by that client's weight, so it cannot be dropped alone). None: only the lower bound
        is checked here; `fedcomp.secagg.CompressedSecAggPlusWorkflow` fills in its own.
    max_epsilon : float, optional
        Privacy budget (run config ``max-epsilon``) with ``client_dp`` or ``distributed_dp``: a round
        whose release could raise the run's epsilon above it samples nobody (``configure_fit``
        returns no clients), and `stopped_reason` says why; every later round likewise. For
        distributed DP the projection assumes the fewest survivors SecAgg+ unmasks (the threshold),
        whose noise is the smallest. None: no budget.

    Attributes
    ----------
    history : dict
        Per round: ``num-replies``, ``failures`` (sampled clients without a masked vector), ``k``, ``dimension``,
        ``clipped`` (entries clipped by clients), ``train-loss`` (example-weighted), ``compression-error`` (mean).
    """

    def __init__(self, strategy: Strategy, density: float, *, rotation: bool = False, error_feedback: bool = True,
                 seed: int = 0, keys: list[str] | None = None, pack: bool = False,
                 client_dp: ClientLevelDP | None = None, max_weight: float | None = None,
                 distributed_dp: DistributedDP | None = None, max_epsilon: float | None = None,
                 server_lr: float = 1.0, server_lr_rounds: int = 0) -> None:
        super().__init__()
        if isinstance(server_lr_rounds, bool) or not isinstance(server_lr_rounds, int) or server_lr_rounds < 0:
            raise ValueError(f"SharedRandomKStrategy: server_lr_rounds must be an integer >= 0, "
                             f"got {server_lr_rounds!r}")
        self.server_lr_rounds = server_lr_rounds
        if isinstance(server_lr, bool) or not isinstance(server_lr, (int, float)) or not 0 < server_lr < float("inf"):
            raise ValueError(f"SharedRandomKStrategy: server_lr (run config 'secagg-server-lr') must be a finite "
                             f"number > 0, got {server_lr!r}")
        self.server_lr = float(server_lr)
        self.max_epsilon = checked_max_epsilon(max_epsilon)
        #: Why no further rounds are run ("" while rounds go on): the privacy budget.
        self.stopped_reason = ""
        self.max_weight = None if max_weight is None else float(max_weight)
        if (client_dp is not None or distributed_dp is not None) and error_feedback:
            raise ValueError("client-level DP under SecAgg+ needs error-feedback = false: with error feedback the "
                             "residual carries the clipped excess into later rounds and voids the clipping bound")
        if client_dp is not None and distributed_dp is not None:
            raise ValueError("SharedRandomKStrategy: client_dp and distributed_dp are two DP modes; pass one")
        self.client_dp = client_dp
        self.distributed_dp = distributed_dp
        #: The current round's SecAgg+ reconstruction threshold (set by CompressedSecAggPlusWorkflow).
        self.round_threshold: int | None = None
        if not 0 < density <= 1:
            raise ValueError(f"SharedRandomKStrategy: density must be in (0, 1], got {density}")
        self.inner, self.density, self.rotation = strategy, float(density), bool(rotation)
        self.error_feedback, self.seed, self.keys, self.pack = bool(error_feedback), int(seed), keys, bool(pack)
        self.history: dict[int, dict[str, float]] = {}
        self._global: list[np.ndarray] | None = None
        self._proj: SharedProjection | None = None
        self._sampled = 0
        #: node id -> the last round whose applied sum included that node's masked vector
        self.included: dict[int, int] = {}
        #: Set by `fedcomp.secagg.CompressedSecAggPlusWorkflow` (it unpacks packed vectors).
        self.unpacking_workflow = False
        #: The last applied round's update as its shared-projection sum (None: that round applied none):
        #: the compressed download sends it instead of the model change (`fedcomp.download.shared_step`).
        self.last_step: SharedStep | None = None

    def step(self, server_round: int) -> float:
        """The factor on the decoded mean update in ``server_round``: ``server_lr``, or with
        ``server_lr_rounds = R > 1`` ``server_lr - (server_lr - 1) * (r - 1) / (R - 1)`` for round r
        (r clamped to [1, R]): ``server_lr`` in round 1, 1 in round R."""
        big_r = self.server_lr_rounds
        if big_r <= 1:
            return self.server_lr
        r = min(max(int(server_round), 1), big_r)
        return self.server_lr - (self.server_lr - 1.0) * (r - 1) / (big_r - 1)

    def __repr__(self) -> str:
        return f"SharedRandomKStrategy({self.inner!r}, density={self.density}, rotation={self.rotation})"

    def describe(self) -> str:
        """One line for logs and ``metrics.json``."""
        return (f"secagg+ shared randomk density={self.density:g}" + (" rotation" if self.rotation else "")
                + ("" if self.error_feedback else " no-ef")
                + ("" if self.server_lr == 1.0 else f" server-lr={self.server_lr:g}")
                + (f" falling to 1 at round {self.server_lr_rounds}" if self.server_lr_rounds > 1
                   and self.server_lr != 1.0 else ""))

    # -- delegated ----------------------------------------------------------------------------
    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        """The inner strategy's initial parameters."""
        return self.inner.initialize_parameters(client_manager)

    def configure_evaluate(self, server_round: int, parameters: Parameters,
                           client_manager: ClientManager) -> list[tuple[ClientProxy, EvaluateIns]]:
        """The inner strategy's evaluation round."""
        return self.inner.configure_evaluate(server_round, parameters, client_manager)

    def aggregate_evaluate(self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]],
                           failures) -> tuple[float | None, dict[str, Scalar]]:
        """The inner strategy's evaluation aggregate."""
        return self.inner.aggregate_evaluate(server_round, results, failures)

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        """The inner strategy's centralised evaluation."""
        return self.inner.evaluate(server_round, parameters)

    # -- the shared encoding --------------------------------------------------------------------
    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        """The inner strategy's sample, each FitIns with its own config plus the round's shared seed,
        ``density``, rotation flag, ``error-feedback``, ``server-round`` (and names, pack flag), and per
        node the last round whose applied sum included its vector (``fedcomp-secagg-applied-round``).

        Raises
        ------
        ValueError
            ``pack=True`` without `fedcomp.secagg.CompressedSecAggPlusWorkflow` (Flower's
            workflow cannot unpack).
        """
        self._global = parameters_to_ndarrays(parameters)
        dim = sum(a.size for a in self._global if a.dtype.kind == "f")
        self._proj = SharedProjection(max(dim, 1), self.density, round_seed(self.seed, server_round), self.rotation)
        if self._over_budget(server_round):
            return []
        extra: dict[str, Scalar] = {
            "server-round": server_round, SECAGG_SEED_KEY: self._proj.seed, "density": self.density,
            SECAGG_ROTATION_KEY: self.rotation, "error-feedback": self.error_feedback, SECAGG_PACK_KEY: self.pack,
        }
        if self.client_dp is not None:
            extra[SECAGG_DP_CLIP_KEY] = float(self.client_dp.clipping_norm)
        if self.distributed_dp is not None:
            if not self.unpacking_workflow:
                raise ValueError("SharedRandomKStrategy(distributed_dp=...) needs fedcomp's "
                                 "CompressedSecAggPlusWorkflow: the accountant needs each round's SecAgg+ threshold, "
                                 "which Flower's workflow does not hand over")
            extra[SECAGG_DP_CLIP_KEY] = float(self.distributed_dp.clipping_norm)
            extra[SECAGG_DDP_NOISE_KEY] = float(self.distributed_dp.noise_multiplier)
        if self.keys is not None:
            if len(self.keys) != len(self._global):
                raise ValueError(f"SharedRandomKStrategy: {len(self.keys)} keys for {len(self._global)} arrays")
            extra[SECAGG_KEYS_KEY] = list(self.keys)  # type: ignore[assignment]
        if self.pack and not self.unpacking_workflow:
            raise ValueError("SharedRandomKStrategy(pack=True) needs fedcomp's CompressedSecAggPlusWorkflow, which "
                             "unpacks the packed masked vectors; Flower's SecAggPlusWorkflow cannot (it would fail "
                             "on them with numpy's 'pickled data' error): use CompressedSecAggPlusWorkflow or "
                             "pack=False (run config secagg-pack = false)")
        sample = self.inner.configure_fit(server_round, parameters, client_manager)
        self._sampled = len(sample)
        return [(proxy, FitIns(ins.parameters, {**ins.config, **extra,
                                                SECAGG_APPLIED_KEY: self.included.get(proxy.node_id, 0)}))
                for proxy, ins in sample]

    def _over_budget(self, server_round: int) -> bool:
        """True (and `stopped_reason` set, logged once) if releasing ``server_round`` could
        raise epsilon above `max_epsilon`."""
        if self.stopped_reason or self.max_epsilon is None:
            return bool(self.stopped_reason)
        nxt = None
        if self.client_dp is not None:
            nxt = self.client_dp.epsilon(self.client_dp.rounds + 1)
        elif self.distributed_dp is not None:
            nxt = self.distributed_dp.epsilon_after(self._proj.k)
        self.stopped_reason = over_budget(server_round, nxt, self.max_epsilon)
        if self.stopped_reason:
            log(WARNING, "fedcomp secagg: %s", self.stopped_reason)
        return bool(self.stopped_reason)

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures) -> tuple[Parameters | None, dict[str, Scalar]]:
        """Decode SecAgg+'s weighted mean of the k values into a model and hand it to the inner strategy.

        Returns ``(None, {})`` (the round is refused, the model kept, an ERROR logged naming the
        nodes) when a client's plain-text ``num_examples`` is not an integer in ``[1, max_weight]``,
        or when the secure aggregate, the decoded model or the inner strategy's aggregate is not finite.

        Raises
        ------
        ValueError
            The aggregate is not one vector of the round's k values.
        """
        self.last_step = None
        if not results or self._proj is None or self._global is None:
            return None, {}
        hi = self.max_weight if self.max_weight is not None else float("inf")
        bad = [(getattr(p, "node_id", p), fr.num_examples) for p, fr in results
               if isinstance(fr.num_examples, bool) or not isinstance(fr.num_examples, (int, np.integer))
               or not 1 <= fr.num_examples <= hi]
        if bad:
            log(ERROR, "fedcomp secagg round %d refused (model kept): num-examples outside [1, %g] from (node, "
                "num-examples) %s; the masked sum carries their weight (raise 'secagg-max-weight' if honest)",
                server_round, hi, bad[:10])
            self.charge_refused_round(server_round, len(results))
            return None, {}
        vec = parameters_to_ndarrays(results[0][1].parameters)
        if len(vec) != 1:
            raise ValueError(f"secure aggregate has {len(vec)} arrays, expected the one vector of k values")
        values, dp_info = vec[0], {}
        if self.client_dp is not None:  # SecAgg+ gave the uniform mean over the survivors: back to their sum
            values, dp_info = self.client_dp.finish(values.astype(np.float64) * len(results), [],
                                                    max(self._sampled, len(results)))
            dp_info.pop("max-update-norm")
            dp_info.pop("clipped-fraction")
        elif self.distributed_dp is not None:  # the noised sum of the survivors, over the clients sampled
            if self.round_threshold is None:
                log(ERROR, "fedcomp secagg round %d refused (model kept): no SecAgg+ threshold for the accountant",
                    server_round)
                return None, {}
            m = len(results)
            values = values.astype(np.float64) * m / max(self._sampled, m)
            dp_info = self.distributed_dp.record(self._proj.k, m, int(self.round_threshold))
        try:
            factor = self.step(server_round)
            delta = self._proj.decode(values) * factor
        except ValueError as exc:  # non-finite or wrong-size aggregate: drop the round, keep the run
            log(ERROR, "fedcomp secagg round %d refused (model kept): %s", server_round, exc)
            return None, {}
        new, off = [], 0
        for g in self._global:
            if g.dtype.kind == "f":
                upd = (g.astype(np.float64) + delta[off : off + g.size].reshape(g.shape)).astype(g.dtype)
                if not np.isfinite(upd).all():
                    log(ERROR, "fedcomp secagg round %d refused (model kept): the aggregated model is not finite "
                        "in its own dtype", server_round)
                    return None, {}
                new.append(upd)
                off += g.size
            else:
                new.append(g.copy())
        total = sum(int(fr.num_examples) for _, fr in results)
        res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(new), total, {})
        agg, _ = self.inner.aggregate_fit(server_round, [(results[0][0], res)], failures)
        if agg is not None:  # inner strategies compute in float64: back to each tensor's dtype
            out = parameters_to_ndarrays(agg)
            if not all(np.isfinite(o).all() for o, g in zip(out, self._global) if g.dtype.kind == "f"):
                log(ERROR, "fedcomp secagg round %d refused (model kept): the inner strategy's aggregate is not "
                    "finite", server_round)
                return None, {}
            out = [o.astype(g.dtype) if g.dtype.kind == "f" else g for o, g in zip(out, self._global)]
            clamped = 0
            for i, name in enumerate(self.keys or []):  # quantization noise must not make a variance negative
                if name.endswith("running_var") and out[i].dtype.kind == "f":
                    clamped += int(np.count_nonzero(out[i] < 0))
                    out[i] = np.maximum(out[i], 0).astype(out[i].dtype)
            if clamped:
                log(WARNING, "fedcomp secagg round %d: %d BatchNorm running_var entries below 0 after the secure "
                    "aggregate (quantization noise) clamped to 0", server_round, clamped)
            agg = ndarrays_to_parameters(out)
            if not all(np.isfinite(a).all() for a in parameters_to_ndarrays(agg) if a.dtype.kind == "f"):
                log(ERROR, "fedcomp secagg round %d refused (model kept): the aggregate overflows its dtype",
                    server_round)
                return None, {}
        if agg is not None:  # these clients commit the residual of this round (fedcomp.secagg.residual)
            self.included.update({p.node_id: server_round for p, _ in results if hasattr(p, "node_id")})
            self.last_step = SharedStep(self._proj, np.asarray(values, dtype=np.float64).reshape(-1), factor)
        metrics = {**self._round_metrics(results, failures), **dp_info}
        self.history[server_round] = metrics
        return agg, metrics

    def charge_refused_round(self, server_round: int, survivors: int) -> None:
        """Distributed DP: count a round whose noised sum SecAgg+ unmasked but that is then refused
        (the model kept): the server has seen that sum, so the accountant composes it like any other.
        Without distributed DP, without this round's threshold or without survivors: nothing.

        Parameters
        ----------
        server_round : int
            For the log.
        survivors : int
            Clients whose masked vectors were in the unmasked sum.
        """
        if self.distributed_dp is None or self.round_threshold is None or survivors < 1 or self._proj is None:
            return
        self.distributed_dp.record(self._proj.k, survivors, int(self.round_threshold))
        log(WARNING, "fedcomp secagg round %d: refused, but its noised sum was unmasked; counted by the privacy "
            "accountant (epsilon now %.4g)", server_round, self.distributed_dp.epsilon())

    def _round_metrics(self, results, failures) -> dict[str, Scalar]:
        ms = [fr.metrics or {} for _, fr in results]
        n = [fr.num_examples for _, fr in results]
        num = reported_number  # untrusted: non-numbers and non-finite count as 0, clamped like the plain path

        return {
            # failures = sampled - replied (Flower 1.42's SecAgg+ workflow lists a failed reply twice)
            "num-replies": len(results), "failures": max(self._sampled - len(results), 0), "k": self._proj.k,
            "dimension": self._proj.dim, "clipped": sum(num(m, "secagg-clipped") for m in ms),
            "train-loss": sum(num(m, "train-loss") * w for m, w in zip(ms, n)) / max(sum(n), 1),
            "compression-error": sum(num(m, "compression-error") for m in ms) / len(ms),
            # what the summed updates would have cost in fp32, from what the server received (not client reports)
            "dense-bytes": float(4 * self._proj.dim * len(results)),
            **({"clipped-fraction": sum(num(m, "secagg-dp-clipped") for m in ms) / len(ms)}
               if self.client_dp or self.distributed_dp else {}),
        }
