"""The legacy API's compressed download (`fedcomp.download.legacy`): FitIns and EvaluateIns carry each
client's step as uint8 arrays and a layout; CompressedNumPyClient and compression_mod rebuild the model
from the client's copy and report its digest; bad layouts are refused."""

from __future__ import annotations

import io
import logging
import threading

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, RecordDict
from flwr.client import NumPyClient
from flwr.common import FitIns, Parameters, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.strategy import FedAvg, FedMedian

from fedcomp.client.numpy_client import CompressedNumPyClient
from fedcomp.compression import PayloadError
from fedcomp.download.legacy import (
    DIGEST_KEY,
    LAYOUT_KEY,
    positional_record,
    rebuild_legacy,
    record_from_legacy,
    record_to_legacy,
)
from fedcomp.strategies.legacy_strategy import LegacyCompressedStrategy

from .legacy_helpers import LinRegClient, N, init_weights, manager


def _inner(evaluate: bool = True) -> FedAvg:
    return FedAvg(fraction_fit=1.0, fraction_evaluate=1.0 if evaluate else 0.0, min_fit_clients=N,
                  min_evaluate_clients=N if evaluate else 0, min_available_clients=N,
                  initial_parameters=ndarrays_to_parameters(init_weights()))


def _rounds(strategy, clients, rounds: int):
    """``rounds`` legacy rounds in process (fit, aggregate, evaluate, aggregate); the global model after each."""
    cm = manager(clients)
    params, models = strategy.initialize_parameters(cm), []
    for rnd in range(1, rounds + 1):
        results = [(proxy, proxy.fit(ins, None, rnd)) for proxy, ins in strategy.configure_fit(rnd, params, cm)]
        params, _ = strategy.aggregate_fit(rnd, results, [])
        evals = [(proxy, proxy.evaluate(ins, None, rnd)) for proxy, ins in strategy.configure_evaluate(rnd, params, cm)]
        strategy.aggregate_evaluate(rnd, evals, [])
        models.append(parameters_to_ndarrays(params))
    return models


def test_the_download_is_the_library_default_and_dense_where_it_cannot_apply():
    assert LegacyCompressedStrategy(_inner(), compressor="sign").download.downstream.compressor == "sign"
    stc = LegacyCompressedStrategy(_inner()).download.downstream
    assert (stc.compressor, stc.density) == ("stc", 0.05)
    assert LegacyCompressedStrategy(_inner(), compressor="none").download is None
    assert LegacyCompressedStrategy(FedMedian(), compressor="sign").download is None  # not a weighted mean
    assert LegacyCompressedStrategy(_inner(), downstream="none").download is None
    assert LegacyCompressedStrategy(_inner(), compressor="sign", downstream="int8").download.downstream.compressor \
        == "int8"


@pytest.mark.parametrize("compressor", ["sign", "stc"])
def test_rounds_with_the_compressed_download_train_as_with_the_dense_one(compressor, caplog):
    """Every client's copy is the one the server records (no re-synchronisation), the model travels in far
    fewer bytes than dense both ways, train and evaluate, and training gets as far as with the dense download."""
    with caplog.at_level(logging.WARNING):
        s = LegacyCompressedStrategy(_inner(), compressor=compressor)
        clients = [CompressedNumPyClient(LinRegClient(i), state=RecordDict()) for i in range(N)]
        compressed = _rounds(s, clients, 8)
    assert "differs from the server's record" not in caplog.text
    dense_s = LegacyCompressedStrategy(_inner(), compressor=compressor, downstream="none")
    dense = _rounds(dense_s, [CompressedNumPyClient(LinRegClient(i), state=RecordDict()) for i in range(N)], 8)
    loss = [np.mean([c.client._loss(*m) for c in clients]) for m in (init_weights(), compressed[-1], dense[-1])]
    assert loss[1] < 0.5 * loss[0] and loss[1] < 1.5 * loss[2]
    # every instruction both phases, as serialised (the step of a round rides its evaluate instruction; the
    # next train instruction, for the same global model, carries none)
    down = sum(h["wire-bytes-down"] for h in s.history.values())
    # (an 18-parameter model: the config, the codec keys and the layout are most of each message)
    assert down < 0.8 * sum(h["wire-bytes-down"] for h in dense_s.history.values())
    assert all(s.download.downstream.nodes.held(str(i)) is not None for i in range(N))


def test_a_client_that_failed_gets_a_first_contact_and_trains_on():
    s = LegacyCompressedStrategy(_inner(evaluate=False), compressor="sign")
    clients = [CompressedNumPyClient(LinRegClient(i), state=RecordDict()) for i in range(N)]
    cm = manager(clients)
    params = s.initialize_parameters(cm)
    for rnd in (1, 2, 3):
        results, failures = [], []
        for proxy, ins in s.configure_fit(rnd, params, cm):
            res = proxy.fit(ins, None, rnd)
            (failures if (rnd == 2 and proxy.cid == "1") else results).append((proxy, res))
        params, metrics = s.aggregate_fit(rnd, results, failures)
        assert metrics["num-replies"] == (N - 1 if rnd == 2 else N)
    assert s.download.downstream.nodes.held("1") is not None


def test_a_legacy_record_round_trips_and_a_bad_layout_is_refused():
    rec = positional_record([np.arange(6, dtype=np.float32).reshape(2, 3), np.array(7, np.int64)])
    arrays, layout = record_to_legacy(rec)
    back = record_from_legacy(arrays, layout)
    assert [(k, a.stype, a.dtype, tuple(a.shape), bytes(a.data)) for k, a in back.items()] == \
        [(k, a.stype, a.dtype, tuple(a.shape), bytes(a.data)) for k, a in rec.items()]
    for bad, match in ((b"[]", "string"), ("not json", "not JSON"), ("[]", "one entry per array"),
                       ('[["0","s","d",[-1]],["1","s","d",[]]]', "not \\[key, stype, dtype, shape\\]"),
                       ('[["0","s","d",[1]],["0","s","d",[]]]', "twice"), ("x" * 5_000_000, "at most")):
        with pytest.raises(PayloadError, match=match):
            record_from_legacy(arrays, bad)
    with pytest.raises(PayloadError, match="1-D uint8"):
        record_from_legacy([arrays[0].astype(np.int16), arrays[1]], layout)


def test_a_download_without_a_copy_to_build_on_is_refused_and_nothing_is_kept():
    """A step on a copy this client does not hold (a server that lost track, or a forged message)."""
    s = LegacyCompressedStrategy(_inner(evaluate=False), compressor="sign")
    cm = manager([CompressedNumPyClient(LinRegClient(i)) for i in range(N)])
    params = s.initialize_parameters(cm)
    (proxy, ins), *_ = s.configure_fit(1, params, cm)
    state = RecordDict()
    out = rebuild_legacy(state, parameters_to_ndarrays(ins.parameters), ins.config)
    assert [a.shape for a in out] == [a.shape for a in init_weights()]
    forged = {**ins.config, "fedcomp-base-version": 5}
    forged.pop("fedcomp-init-seed", None)
    with pytest.raises(Exception, match="keeps no model copy"):
        rebuild_legacy(RecordDict(), parameters_to_ndarrays(ins.parameters), forged)
    assert LAYOUT_KEY in ins.config and rebuild_legacy(state, init_weights(), {}) is None


def test_the_digest_leaves_the_metrics_before_the_inner_strategy_sees_them():
    seen = []

    def agg(metrics):
        seen.extend(m for _, m in metrics)
        return {}

    inner = _inner(evaluate=False)
    inner.fit_metrics_aggregation_fn = agg
    s = LegacyCompressedStrategy(inner, compressor="sign")
    _rounds(s, [CompressedNumPyClient(LinRegClient(i)) for i in range(N)], 1)
    assert seen and all(DIGEST_KEY not in m for m in seen)


def test_legacy_serverapp_with_evaluation_rides_the_download():
    """ServerApp(server_fn) + ClientApp(client_fn) in process, both client sides, federated evaluation on."""
    from flwr.clientapp import ClientApp
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig

    from fedcomp.client import compression_mod

    from .test_legacy import _legacy_grid

    def client_fn_for(side):
        def client_fn(context: Context):
            inner = LinRegClient(int(context.node_config["partition-id"]))
            return (inner if side == "mod" else CompressedNumPyClient(inner, state=context.state)).to_client()
        return client_fn

    for side in ("numpy-client", "mod"):
        app = ClientApp(client_fn=client_fn_for(side), mods=[compression_mod] if side == "mod" else [])
        made = []

        def server_fn(context: Context):
            made.append(LegacyCompressedStrategy(_inner(), compressor="sign"))
            return ServerAppComponents(strategy=made[0], config=ServerConfig(num_rounds=3))

        grid = _weighing(_legacy_grid(app))
        ServerApp(server_fn=server_fn)(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                                     run_config={}))
        (s,) = made
        assert sorted(s.history) == [1, 2, 3] and all(h["num-replies"] == N for h in s.history.values())
        assert not s.download.downstream.resynced
        assert 0 < s.history[1]["download-bytes"] and s.history[3]["download-bytes"] < 4 * 18 * N
        # the strategy's count of every instruction and result equals an outside one: nothing in a reply is
        # lost in Flower's compat layer (compression_mod writes a legacy result's figures into its metrics)
        assert sum(h["wire-bytes-down"] for h in s.history.values()) == grid.down
        assert sum(h["wire-bytes-up"] for h in s.history.values()) == grid.up


def _weighing(grid):
    """``grid`` that adds up the serialised content of every message it carries (the outside count)."""
    from flwr.common.serde import recorddict_to_proto

    send, lock = grid.send_and_receive, threading.Lock()  # Flower's legacy server sends from several threads
    grid.down = grid.up = 0

    def weighing(messages, *, timeout=None):
        messages = list(messages)
        down = sum(recorddict_to_proto(m.content).ByteSize() for m in messages)
        out = list(send(messages, timeout=timeout))
        up = sum(recorddict_to_proto(r.content).ByteSize() for r in out if not r.has_error())
        with lock:
            grid.down, grid.up = grid.down + down, grid.up + up
        return out

    grid.send_and_receive = weighing
    return grid


# -- found by an attack round on the legacy download ------------------------------------------------

class _MixedClient(NumPyClient):
    """A model with an integer tensor between float tensors and an empty one: fit adds 0.01 / 1."""

    def fit(self, parameters, config):
        return [p + (1 if p.dtype.kind == "i" else 0.01) for p in parameters], 10, {}

    def evaluate(self, parameters, config):
        return float(sum(float(np.abs(p).sum()) for p in parameters)), 10, {}


def _mixed_model():
    return [np.ones(3, np.float32), np.arange(5, dtype=np.int32), np.zeros((0, 3), np.float32),
            np.full(6, 2.0, np.float32)]


@pytest.mark.parametrize("downstream", ["none", "auto"])
def test_integer_and_empty_tensors_between_float_ones_travel_in_position_order(downstream):
    """The payloads of a result travel in the arrays' order (the float tensors' were first), so every
    result of an honest client is accepted whatever its tensors' order."""
    inner = FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=N, min_available_clients=N,
                   initial_parameters=ndarrays_to_parameters(_mixed_model()))
    s = LegacyCompressedStrategy(inner, compressor="sign", downstream=downstream)
    cm = manager([CompressedNumPyClient(_MixedClient(), state=RecordDict()) for _ in range(N)])
    params = s.initialize_parameters(cm)
    for rnd in (1, 2):
        results = [(p, p.fit(ins, None, rnd)) for p, ins in s.configure_fit(rnd, params, cm)]
        params, metrics = s.aggregate_fit(rnd, results, [])
        assert metrics["num-replies"] == N and metrics["rejected-replies"] == 0
    out = parameters_to_ndarrays(params)  # (the integer tensor's values are Flower's legacy FedAvg's to average)
    assert out[1].dtype == np.int32 and out[2].shape == (0, 3) and np.allclose(out[3], 2.02)


def test_a_client_without_fedcomp_does_not_count_in_federated_evaluation(caplog):
    """It reads the compressed download's bytes as its model: its evaluate result is left out, named."""
    class Plain(NumPyClient):
        def evaluate(self, parameters, config):
            return 1e9, 10, {}

    s = LegacyCompressedStrategy(_inner(), compressor="sign")
    clients = [CompressedNumPyClient(LinRegClient(0)), Plain(), CompressedNumPyClient(LinRegClient(2))]
    cm = manager(clients)
    params = s.initialize_parameters(cm)
    evals = [(p, p.evaluate(ins, None, 1)) for p, ins in s.configure_evaluate(1, params, cm)]
    with caplog.at_level(logging.WARNING):
        loss, _ = s.aggregate_evaluate(1, evals, [])
    assert loss < 1e3 and "report no copy" in caplog.text and "'1'" in caplog.text


def test_a_refused_rebuild_keeps_the_held_copy():
    state = RecordDict()
    s = LegacyCompressedStrategy(_inner(evaluate=False), compressor="sign")
    cm = manager([CompressedNumPyClient(LinRegClient(i)) for i in range(N)])
    (_, ins), *_ = s.configure_fit(1, s.initialize_parameters(cm), cm)
    rebuild_legacy(state, parameters_to_ndarrays(ins.parameters), ins.config)
    before = {k: dict(state[k]) for k in state.keys()}
    named = ArrayRecord({"a": Array(np.ones(2, np.float32)), "b": Array(np.ones(1, np.float32))})
    arrays, layout = record_to_legacy(named)
    with pytest.raises(PayloadError, match="by position"):
        rebuild_legacy(state, arrays, {LAYOUT_KEY: layout, "fedcomp-model-version": 9})
    assert {k: dict(state[k]) for k in state.keys()} == before  # the copy and its version as they were


def test_hostile_legacy_downloads_get_a_clear_error():
    from flwr.compat.common import recorddict_compat as compat

    from fedcomp.download.legacy import expand_legacy_message

    from ..messages import make_msg

    huge = np.lib.format.header_data_from_array_1_0(np.zeros(1, np.uint8))
    huge["shape"] = (10**13,)  # a header that claims 10 TB, and no body
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, huge)
    fitins = compat.fitins_to_recorddict(FitIns(Parameters([buf.getvalue()], "numpy.ndarray"),
                                                {LAYOUT_KEY: '[["0","s","uint8",[1]]]'}), keep_input=True)
    with pytest.raises(PayloadError, match="bytes follow|claims"):
        expand_legacy_message(make_msg(fitins))
    with pytest.raises(PayloadError, match="not JSON"):
        record_from_legacy([], "[" * 100_000 + "]" * 100_000)
    with pytest.raises(Exception, match=r"2\*\*63 - 1"):
        rebuild_legacy(RecordDict(), [], {LAYOUT_KEY: "[]", "fedcomp-model-version": 2**80})
