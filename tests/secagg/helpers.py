"""A one-round SecAgg+ federation in process: Flower's DefaultWorkflow + our workflow and strategy,
clients whose 'training' adds a known update (so the expected aggregate is computable exactly)."""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key
from flwr.server import LegacyContext, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.server.workflow import DefaultWorkflow

from fedcomp.run.inprocess_grid import CLIENT_APP_RAISED_EXCEPTION, InProcessGrid
from fedcomp.secagg import CompressedSecAggPlusWorkflow, SharedRandomKStrategy, secagg_mod

SHAPES = {"w": (40, 50), "b": (50,), "steps": ()}  # 2050 float entries + one int64 0-d buffer


def global_model(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(size=SHAPES["w"]).astype(np.float32), "b": rng.normal(size=SHAPES["b"]).astype(np.float32),
            "steps": np.array(7, dtype=np.int64)}


def client_delta(pid: int, scale: float = 0.01) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + pid)
    return {"w": (scale * rng.normal(size=SHAPES["w"])).astype(np.float32),
            "b": (scale * rng.normal(size=SHAPES["b"])).astype(np.float32), "steps": np.array(3, dtype=np.int64)}


def num_examples(pid: int) -> int:
    return 50 + 37 * pid


def make_client_app(scale: float = 0.01, mods=(secagg_mod,)) -> ClientApp:
    """Clients whose training adds :func:`client_delta`; ``mods`` as fedcomp's own app has them:
    ``(secagg_mod, compression_mod)``."""
    app = ClientApp(mods=list(mods))

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        d = client_delta(pid, scale)
        new = {k: Array(np.array(a.numpy() + d[k], copy=True, order="C")) for k, a in msg.content["arrays"].items()}
        metrics = MetricRecord({"num-examples": num_examples(pid), "train-loss": 1.0})
        return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": metrics}), reply_to=msg)

    return app


class RecordingGrid(InProcessGrid):
    """Keeps every masked-vector reply as it travelled; ``drop`` partition ids fail in the collect stage
    (after sharing keys), ``corrupt`` ones send a truncated packed vector."""

    def __init__(self, *a, drop=(), corrupt=(), **kw):
        super().__init__(*a, **kw)
        self.drop, self.corrupt, self.masked = set(drop), set(corrupt), {}

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        pid = {nid: ctx.node_config["partition-id"] for nid, ctx in self.contexts.items()}
        keep = [m for m in messages if not ("fitins.parameters" in m.content.array_records
                                            and pid[m.metadata.dst_node_id] in self.drop)]
        out = list(super().send_and_receive(keep, timeout=timeout))
        for m in messages:
            if m not in keep:
                out.append(Message(Error(code=CLIENT_APP_RAISED_EXCEPTION, reason="dropped"), reply_to=m))
        for r in out:
            if not r.has_error() and Key.MASKED_PARAMETERS in r.content.config_records.get(RECORD_KEY_CONFIGS, {}):
                rec = r.content.config_records[RECORD_KEY_CONFIGS]
                p = pid[r.metadata.src_node_id]
                self.masked[p] = list(rec[Key.MASKED_PARAMETERS])
                if p in self.corrupt:
                    rec[Key.MASKED_PARAMETERS] = [b[:-3] for b in rec[Key.MASKED_PARAMETERS]]
        return out


def tampering_grid(fn, victim=4):
    """A :class:`RecordingGrid` whose partition ``victim`` sends ``fn(its masked blobs)`` instead."""
    class G(RecordingGrid):
        def send_and_receive(self, messages, *, timeout=None):
            out = list(super().send_and_receive(messages, timeout=timeout))
            pid = {nid: c.node_config["partition-id"] for nid, c in self.contexts.items()}
            for r in out:
                rec = r.content.config_records.get(RECORD_KEY_CONFIGS, {}) if not r.has_error() else {}
                if Key.MASKED_PARAMETERS in rec and pid[r.metadata.src_node_id] == victim:
                    rec[Key.MASKED_PARAMETERS] = fn(list(rec[Key.MASKED_PARAMETERS]))
            return out
    return G


class RoundCountingGrid(RecordingGrid):
    """A :class:`RecordingGrid` that counts rounds (setup stages) in ``round`` and calls
    ``on_round(round)`` before each round's setup messages go out."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.round = 0

    def on_round(self, server_round: int) -> None:
        """Hook: a new round starts."""

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        if any(RECORD_KEY_CONFIGS in m.content.config_records
               and m.content.config_records[RECORD_KEY_CONFIGS].get(Key.STAGE) == "setup" for m in messages):
            self.round += 1
            self.on_round(self.round)
        return super().send_and_receive(messages, timeout=timeout)


def run_round(n: int, density: float, **kw):
    """One SecAgg+ round; returns (new model dict, strategy, workflow, grid)."""
    models, strategy, workflow, grid = run_rounds(1, n, density, **kw)
    return models[1], strategy, workflow, grid


def run_rounds(num_rounds: int, n: int, density: float, *, rotation=False, pack=True, drop=(), corrupt=(), scale=0.01,
               clipping_range=1.0, qbits=16, shares=1.0, threshold=0.6, ef=True, inner_cls=FedAvg, client_dp=None,
               distributed_dp=None, node_configs=None, mods=(secagg_mod,), workflow_cls=None, server_lr=1.0,
               download=None, pack_protocol=True, grid_cls=None, **inner_kw):
    """``num_rounds`` SecAgg+ rounds; returns ({round: model dict after it}, strategy, workflow, grid).
    ``download``: a `fedcomp.download.secagg.SecAggDownload` for the model (None: dense)."""
    g = global_model()
    keys = list(g)
    grid = (grid_cls or RecordingGrid)(make_client_app(scale, mods), n, {}, node_configs, drop=drop, corrupt=corrupt)
    captured = {}

    def evaluate_fn(rnd, arrays, config):
        captured[rnd] = arrays
        return 0.0, {}

    inner_kw = {"fraction_fit": 1.0, "min_fit_clients": n, "min_available_clients": n, **inner_kw}
    # fedcomp's workflow options, only where a test sets them (Flower's own workflow takes none)
    ours = {k: v for k, v in (("download", download), ("pack_protocol", pack_protocol))
            if v is not None and v is not True}
    initial = ndarrays_to_parameters([g[k] for k in keys])
    if download is not None:
        initial = download.start(initial)
    inner = inner_cls(**inner_kw, fraction_evaluate=0.0, min_evaluate_clients=0, evaluate_fn=evaluate_fn,
                      initial_parameters=initial)
    strategy = SharedRandomKStrategy(inner, density, rotation=rotation, error_feedback=ef, seed=3, keys=keys, pack=pack,
                                     client_dp=client_dp, distributed_dp=distributed_dp, server_lr=server_lr)
    workflow = (workflow_cls or CompressedSecAggPlusWorkflow)(shares, threshold, max_weight=1000.0,
                                                              clipping_range=clipping_range,
                                                              quantization_range=1 << qbits, **ours)
    ctx = LegacyContext(Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                        config=ServerConfig(num_rounds=num_rounds), strategy=strategy)
    DefaultWorkflow(fit_workflow=workflow)(grid, ctx)
    return {r: dict(zip(keys, captured[r])) for r in range(1, num_rounds + 1)}, strategy, workflow, grid
