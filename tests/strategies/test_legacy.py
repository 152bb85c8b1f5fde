"""Legacy Flower API: CompressedNumPyClient + LegacyCompressedStrategy around FedAvg, FedProx, FedAdam.

The legacy strategies are driven directly (configure_fit -> each client's fit through Flower's
NumPyClient adapter -> aggregate_fit), next to an unwrapped copy of the same strategy fed
dense results, so every aggregate can be compared exactly. The end of the file runs the
legacy ``ServerApp(server_fn=...)`` / ``ClientApp(client_fn=...)`` pair in process.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.strategy import FedAvg

import fedcomp.compression as fc
from fedcomp.client import CompositionError
from fedcomp.client.numpy_client import LEGACY_RESIDUAL_STATE_KEY, CompressedNumPyClient
from fedcomp.strategies.legacy_decode import decode_legacy_update, payloads_from_parameters
from fedcomp.strategies.legacy_strategy import LegacyCompressedStrategy

from .legacy_helpers import LinRegClient, N, fit_all, init_weights, make_inner, manager


def nd(params):
    return parameters_to_ndarrays(params)


@pytest.mark.parametrize("inner", ["fedavg", "fedprox", "fedadam"])
def test_none_codec_equals_unwrapped_strategy_over_two_rounds(inner):
    plain = [LinRegClient(i) for i in range(N)]
    ref, cm_ref = make_inner(inner), manager(plain)
    wrapped = LegacyCompressedStrategy(make_inner(inner), compressor="none")
    cm = manager([CompressedNumPyClient(c) for c in plain])
    p_ref = p = wrapped.initialize_parameters(cm)
    for rnd in (1, 2):
        # `none` sends each tensor in its own dtype: float32 in round 1, float64 once Flower's legacy
        # aggregate has made the global weights float64
        none_bytes = sum(len(fc.get_compressor("none").compress(torch.from_numpy(a))) for a in nd(p))
        p_ref, _ = ref.aggregate_fit(rnd, fit_all(ref, rnd, p_ref, cm_ref), [])
        p, metrics = wrapped.aggregate_fit(rnd, fit_all(wrapped, rnd, p, cm), [])
        for a, b in zip(nd(p), nd(p_ref)):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
        assert metrics["num-replies"] == N and metrics["rejected-replies"] == 0
        assert metrics["upload-bytes-none"] == metrics["upload-bytes"] == N * none_bytes
    assert not np.allclose(nd(p)[0], init_weights()[0])


def test_fedprox_and_codec_keys_reach_the_client():
    seen = {}

    class Spy(LinRegClient):
        def fit(self, parameters, config):
            seen.update(config)
            return super().fit(parameters, config)

    s = LegacyCompressedStrategy(make_inner("fedprox"), compressor="sign")
    cm = manager([CompressedNumPyClient(Spy(i)) for i in range(N)])
    fit_all(s, 1, s.initialize_parameters(cm), cm)
    assert seen["proximal_mu"] == 0.1 and seen["compressor"] == "sign"
    assert seen.get("error-feedback", True) is True  # a key at its default is not sent; the client reads the default


@pytest.mark.parametrize("inner", ["fedavg", "fedadam"])
def test_corrupt_payload_is_dropped_and_equals_aggregation_without_it(inner, caplog):
    plain = [LinRegClient(i) for i in range(N)]
    params = ndarrays_to_parameters(init_weights())
    # reference: the same wrapped strategy with only clients 0 and 1
    ref = LegacyCompressedStrategy(make_inner(inner), compressor="none")
    cm_ref = manager([CompressedNumPyClient(c) for c in plain[:2]])
    ref.strategy.min_fit_clients = ref.strategy.min_available_clients = 2
    p_ref, _ = ref.aggregate_fit(1, fit_all(ref, 1, params, cm_ref), [])

    s = LegacyCompressedStrategy(make_inner(inner), compressor="none")
    cm = manager([CompressedNumPyClient(c) for c in plain])
    with caplog.at_level(logging.WARNING):
        p, m = s.aggregate_fit(1, fit_all(s, 1, params, cm, corrupt_cid="2"), [])
    for a, b in zip(nd(p), nd(p_ref)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert m["rejected-replies"] == 1 and m["num-replies"] == 2 and m["failed-clients"] == 0
    assert "rejected fit result from client 2" in caplog.text and "bad magic" in caplog.text


def test_all_corrupt_or_accept_failures_false_keeps_the_model():
    s = LegacyCompressedStrategy(FedAvg(min_fit_clients=N, min_available_clients=N, accept_failures=False),
                                 compressor="none")
    cm = manager([CompressedNumPyClient(LinRegClient(i)) for i in range(N)])
    p, m = s.aggregate_fit(1, fit_all(s, 1, ndarrays_to_parameters(init_weights()), cm, corrupt_cid="0"), [])
    assert p is None and m["rejected-replies"] == 1  # FedAvg's own policy: a failure skips the round


def test_implausible_num_examples_is_rejected():
    s = LegacyCompressedStrategy(make_inner("fedavg"), compressor="none", max_num_examples=1000)
    cm = manager([CompressedNumPyClient(LinRegClient(i)) for i in range(N)])
    results = fit_all(s, 1, s.initialize_parameters(cm), cm)
    results[0][1].num_examples = 10**6
    _, m = s.aggregate_fit(1, results, [])
    assert m["rejected-replies"] == 1 and m["num-replies"] == 2


def test_bytes_counted_are_the_payload_lengths():
    s = LegacyCompressedStrategy(make_inner("fedavg"), compressor="sign")
    clients = [CompressedNumPyClient(LinRegClient(i)) for i in range(N)]
    cm = manager(clients)
    results = fit_all(s, 1, s.initialize_parameters(cm), cm)
    payload_bytes = [sum(a.size for a in nd(res.parameters)) for _, res in results]
    for (_, res), nbytes in zip(results, payload_bytes):
        assert res.metrics["upload-bytes"] == float(nbytes)
        assert res.metrics["dense-bytes"] == 4.0 * (15 + 3)
    _, m = s.aggregate_fit(1, results, [])
    assert m["upload-bytes"] == m["upload-bytes-sign"] == float(sum(payload_bytes))
    assert m["dense-bytes"] == N * 4.0 * 18
    assert m["compression-ratio"] == pytest.approx(m["dense-bytes"] / m["upload-bytes"])
    assert s.history[1] == {k: v for k, v in m.items() if k in s.history[1]}
    # sign: one scale + 1 bit per entry, per array, plus the header; 2 arrays per client
    assert all(nbytes < 4 * 18 for nbytes in payload_bytes)


def test_error_feedback_residual_telescopes_and_survives_in_context_state():
    g = init_weights()
    config = {"compressor": "sign", "error-feedback": True}
    state = RecordDict()
    inner = LinRegClient(0)
    sent_sum = [np.zeros_like(a) for a in g]
    delta_sum = [np.zeros_like(a) for a in g]
    for _ in range(2):  # a new wrapper per round, as client_fn(context) does
        client = CompressedNumPyClient(inner, state=state)
        payloads, n, _ = client.fit(g, config)
        assert all(p.dtype == np.uint8 and p.ndim == 1 for p in payloads) and n == 10
        trained, _, _ = inner.fit(g, config)
        for i, p in enumerate(payloads):
            sent_sum[i] += fc.decompress(p.tobytes()).numpy()
            delta_sum[i] += trained[i] - g[i]
    residual = [state[LEGACY_RESIDUAL_STATE_KEY][str(i)].numpy() for i in range(2)]
    assert np.abs(residual[0]).sum() > 0
    for s_, r, d in zip(sent_sum, residual, delta_sum):
        np.testing.assert_allclose(s_ + r, d, atol=1e-5)
    assert client.residuals.keys() == {"0", "1"}


def test_whole_model_selection_sends_one_payload():
    g = init_weights()
    client = CompressedNumPyClient(LinRegClient(1))
    payloads, _, _ = client.fit(g, {"compressor": "topk", "density": 1.0})
    assert len(payloads) == 1  # stc/topk/randomk select over the flattened model by default
    trained, _, _ = LinRegClient(1).fit(g, {})
    dense, info = decode_legacy_update(payloads_from_parameters(ndarrays_to_parameters(payloads)), g)
    for a, b in zip(dense, trained):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert info["codecs"] == {"topk": payloads[0].size}


def test_forced_codec_overrides_the_server():
    client = CompressedNumPyClient(LinRegClient(0), compressor="int8", block_size=4, seed=3)
    payloads, _, _ = client.fit(init_weights(), {"compressor": "sign"})
    assert {fc.codec_name(p.tobytes()) for p in payloads} == {"int8"}
    with pytest.raises(TypeError) as err:
        CompressedNumPyClient(LinRegClient(0), denisty=0.1)
    assert str(err.value) == "unknown codec parameter(s) ['denisty']: 'denisty': did you mean 'density'?"
    with pytest.raises(ValueError, match="density"):
        CompressedNumPyClient(LinRegClient(0), density=2.0)


def test_client_refuses_a_server_without_the_wrapper():
    with pytest.raises(CompositionError, match="LegacyCompressedStrategy"):
        CompressedNumPyClient(LinRegClient(0)).fit(init_weights(), {"proximal_mu": 0.1})


def test_dense_reply_is_rejected_with_a_hint(caplog):
    s = LegacyCompressedStrategy(make_inner("fedavg"), compressor="sign", downstream="none")  # a plain client reads it
    clients = [CompressedNumPyClient(LinRegClient(0)), LinRegClient(1), CompressedNumPyClient(LinRegClient(2))]
    cm = manager(clients)
    with caplog.at_level(logging.WARNING):
        p, m = s.aggregate_fit(1, fit_all(s, 1, s.initialize_parameters(cm), cm), [])
    assert p is not None and m["rejected-replies"] == 1 and m["num-replies"] == 2
    assert ("client 1" in caplog.text
            and "wrap the client in fedcomp.client.numpy_client.CompressedNumPyClient" in caplog.text)


def test_npy_header_claiming_a_huge_array_is_rejected_without_allocating():
    import io

    from numpy.lib import format as npy_format

    buf = io.BytesIO()
    npy_format.write_array_header_1_0(buf, {"descr": "|u1", "fortran_order": False, "shape": (2**45,)})
    params = ndarrays_to_parameters([])
    params.tensors = [buf.getvalue() + b"FCMP"]
    with pytest.raises(fc.PayloadError, match="claims"):
        payloads_from_parameters(params)


def test_constructor_validation():
    with pytest.raises(TypeError, match="CompressedStrategy"):
        from flwr.serverapp.strategy import FedAvg as MessageFedAvg

        LegacyCompressedStrategy(MessageFedAvg())
    with pytest.raises(ValueError, match="compressor"):
        LegacyCompressedStrategy(make_inner("fedavg"), compressor="zip")
    with pytest.raises(RuntimeError, match="without configure_fit"):
        LegacyCompressedStrategy(make_inner("fedavg")).aggregate_fit(5, [], [])
    with pytest.raises(TypeError, match="NumPyClient"):
        CompressedNumPyClient(object())


# -- the legacy runtime: ServerApp(server_fn) + ClientApp(client_fn), in process ---------------

def _legacy_grid(client_app):
    from fedcomp.run.inprocess_grid import InProcessGrid

    class LegacyGrid(InProcessGrid):
        """The compat layer reads ``grid.run.run_id``."""

        @property
        def run(self):
            from types import SimpleNamespace

            return SimpleNamespace(run_id=1)

    return LegacyGrid(client_app, N, {})


@pytest.mark.parametrize("client_side", ["numpy-client", "mod"])
def test_legacy_serverapp_and_clientapp_in_process(client_side):
    from flwr.clientapp import ClientApp
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig

    from fedcomp.client import compression_mod

    def client_fn(context: Context):
        inner = LinRegClient(int(context.node_config["partition-id"]))
        if client_side == "mod":
            return inner.to_client()
        return CompressedNumPyClient(inner, state=context.state).to_client()

    client_app = ClientApp(client_fn=client_fn, mods=[compression_mod] if client_side == "mod" else [])
    strategies = []

    def server_fn(context: Context):
        s = LegacyCompressedStrategy(make_inner("fedavg"), compressor="sign")
        strategies.append(s)
        return ServerAppComponents(strategy=s, config=ServerConfig(num_rounds=2))

    grid = _legacy_grid(client_app)
    ServerApp(server_fn=server_fn)(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                                 run_config={}))
    (s,) = strategies
    assert sorted(s.history) == [1, 2]
    for rnd in (1, 2):
        assert s.history[rnd]["num-replies"] == N and s.history[rnd]["rejected-replies"] == 0
        assert 0 < s.history[rnd]["upload-bytes-sign"] < s.history[rnd]["dense-bytes"]
    state_key = LEGACY_RESIDUAL_STATE_KEY if client_side == "numpy-client" else "fedcomp.residual"
    assert all(state_key in ctx.state for ctx in grid.contexts.values())


# -- the deprecated Ray path: flwr.simulation.start_simulation ----------------------------------

START_SIMULATION = """
import json, sys
from flwr.common import ndarrays_to_parameters
from flwr.server import ServerConfig
from flwr.server.strategy import FedAvg
from flwr.simulation import start_simulation
from fedcomp.client.numpy_client import CompressedNumPyClient
from fedcomp.strategies.legacy_strategy import LegacyCompressedStrategy
from tests.strategies.legacy_helpers import LinRegClient, init_weights

inner = FedAvg(min_fit_clients=2, min_available_clients=2, fraction_evaluate=0.0,
               initial_parameters=ndarrays_to_parameters(init_weights()))
s = LegacyCompressedStrategy(inner, compressor="sign")

def client_fn(context):
    pid = int(context.node_config["partition-id"])
    return CompressedNumPyClient(LinRegClient(pid), state=context.state).to_client()

start_simulation(client_fn=client_fn, num_clients=2, config=ServerConfig(num_rounds=2), strategy=s,
                 client_resources={"num_cpus": 1},
                 ray_init_args={"num_cpus": 2, "include_dashboard": False, "log_to_driver": False})
print("HISTORY " + json.dumps(s.history))
"""


def test_deprecated_start_simulation_still_runs_the_legacy_pair():
    """Flower 1.42 keeps ``flwr.simulation.start_simulation`` (deprecated since 1.13, Ray); about 20 s.
    Run in a child process of its own session so that Ray's processes end with it."""
    import json
    import os
    import pathlib
    import signal
    import subprocess
    import sys

    pytest.importorskip("ray")
    repo = pathlib.Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", START_SIMULATION], cwd=repo, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # our own child's process group only
        out, _ = proc.communicate()
        pytest.fail("start_simulation did not finish in 150 s:\n" + out[-3000:])
    line = [ln for ln in out.splitlines() if ln.startswith("HISTORY ")]
    assert line, out[-3000:]
    history = json.loads(line[0][len("HISTORY "):])
    assert sorted(history) == ["1", "2"]
    assert all(h["num-replies"] == 2 and h["upload-bytes-sign"] > 0 for h in history.values())
    assert "start_simulation() is deprecated" in out
