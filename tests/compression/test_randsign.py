"""randsign (sign on a shared random subset): exact sizes below one bit per entry, decoded values,
positions the decoder rebuilds from the seed, hostile payloads, and downstream use."""

import logging
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fedcomp.compression as fc
from fedcomp.compression.randomk import random_positions
from fedcomp.compression.wire import pack_header, parse_header

from .helpers import decodes_or_payload_error, flip_and_cut

PARAMS = "<QQf"  # k, seed, scale: the wire format's parameters


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def header_bytes(x: torch.Tensor) -> int:
    return len(pack_header(fc.CODECS["randsign"].codec_id, x.dtype, tuple(x.shape), b"\0" * 20))


@pytest.mark.parametrize("density", [1.0, 0.5, 0.25, 0.1, 0.01])
@pytest.mark.parametrize("n", [1, 7, 1000, 47104])
def test_size_is_ceil_k_over_8_bytes_plus_params_and_header(n, density):
    x = randn(n)
    p = fc.get_compressor("randsign", density=density, seed=3).compress(x)
    k = min(max(round(density * n), 1), n)
    assert len(p) == header_bytes(x) + (k + 7) // 8
    if n >= 1000:  # bits per entry: density, plus at most one padding byte and the fixed part
        assert density <= 8 * len(p) / n <= density + 8 * (header_bytes(x) + 1) / n


def test_decode_is_plus_minus_mean_abs_of_the_kept_entries_at_the_seeded_positions():
    x = randn(3000, seed=1)
    p = fc.get_compressor("randsign", density=0.25, seed=9).compress(x)
    k, seed, scale = struct.unpack(PARAMS, parse_header(p).params)
    pos = torch.from_numpy(random_positions(seed, 3000, k))
    assert k == 750 and pos.numel() == 750
    assert scale == pytest.approx(float(x[pos].abs().mean()), rel=1e-6)
    want = torch.zeros(3000)
    want[pos] = torch.where(x[pos] >= 0, torch.tensor(scale), torch.tensor(-scale))
    out = fc.decompress(p)
    assert out.dtype == torch.float32 and torch.equal(out, want)
    # the decoder's positions are the encoder's: exactly the k seeded ones are non-zero
    assert torch.equal(torch.nonzero(out).flatten(), pos)


def test_sparse_decode_gives_the_same_positions_and_values():
    from fedcomp.compression.decoding import decompress_sparse

    x = randn(5000, seed=2)
    p = fc.get_compressor("randsign", density=0.1, seed=4).compress(x)
    pos, vals = decompress_sparse(p)
    dense = fc.decompress(p)
    assert np.array_equal(pos, np.flatnonzero(dense.numpy())) and np.array_equal(vals, dense.numpy()[pos])


def test_same_seed_same_payload_and_fresh_positions_each_call():
    x = randn(2000, seed=5)
    a, b = (fc.get_compressor("randsign", density=0.2, seed=11) for _ in range(2))
    first = a.compress(x)
    assert first == b.compress(x)
    second = a.compress(x)  # the next call draws another seed, so other positions
    assert (torch.nonzero(fc.decompress(first)).flatten().tolist()
            != torch.nonzero(fc.decompress(second)).flatten().tolist())


def test_zeros_shapes_and_half_precision():
    z = torch.zeros(100)
    assert torch.equal(fc.decompress(fc.get_compressor("randsign", density=0.5, seed=0).compress(z)), z)
    e = torch.zeros(0, 3)
    out = fc.decompress(fc.get_compressor("randsign", density=0.5, seed=0).compress(e))
    assert out.shape == (0, 3)
    s = torch.tensor(-2.5)
    assert fc.decompress(fc.get_compressor("randsign", density=0.5, seed=0).compress(s)).item() == -2.5
    h = randn(4, 64).half()
    out = fc.decompress(fc.get_compressor("randsign", density=0.5, seed=0).compress(h))
    assert out.shape == (4, 64) and int((out != 0).sum()) == 128


def test_density_one_is_sign_plus_the_seed():
    x = randn(999, seed=6)
    out = fc.decompress(fc.get_compressor("randsign", density=1.0, seed=0).compress(x))
    sign = fc.decompress(fc.get_compressor("sign").compress(x))
    assert torch.equal(out > 0, sign > 0) and torch.allclose(out, sign, rtol=1e-6, atol=0)  # scale: fp64 vs fp32 mean


def test_error_feedback_sends_every_entry_over_time():
    """With error feedback the entries not drawn this round are carried: the running sum of what
    was sent tracks the running sum of the inputs (relative error shrinks with the rounds)."""
    ef = fc.ErrorFeedback(fc.get_compressor("randsign", density=0.25, seed=1))
    total_in, total_out = torch.zeros(4000), torch.zeros(4000)
    for t in range(60):
        x = randn(4000, seed=100 + t)
        total_in += x
        total_out += fc.decompress(ef.compress(x))
    assert float((total_in - total_out).norm() / total_in.norm()) < 0.6


def _payload(k, seed, scale, body, n=100):
    return pack_header(fc.CODECS["randsign"].codec_id, torch.float32, (n,), struct.pack(PARAMS, k, seed, scale)) + body


@pytest.mark.parametrize("payload, match", [
    (_payload(101, 1, 1.0, b"\0" * 13), "k = 101 exceeds"),
    (_payload(10, 1, float("nan"), b"\0" * 2), "scale"),
    (_payload(10, 1, -1.0, b"\0" * 2), "scale"),
    (_payload(10, 1, 1.0, b"\0"), "sign bits|truncated|bytes"),
    (_payload(10, 1, 1.0, b"\0" * 3), "trailing|bytes"),
    (_payload(10, 1, 1.0, b"\0\xff"), "padding"),
])
def test_bad_payloads_raise_payload_error(payload, match):
    with pytest.raises(fc.PayloadError, match=match):
        fc.decompress(payload)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_corrupted_payloads_decode_or_raise_payload_error(data):
    p = fc.get_compressor("randsign", density=0.3, seed=2).compress(randn(200, seed=7))
    decodes_or_payload_error(flip_and_cut(p, data))


def test_downstream_randsign_rebuilds_the_server_record_bit_for_bit():
    """randsign as the downstream codec (one flat vector of the whole model): every client's model
    equals the server's record bit for bit under partial participation, and an in-sync client's
    broadcast costs about density bits per entry."""
    from flwr.app import ArrayRecord, ConfigRecord
    from flwr.serverapp.strategy import FedAvg

    from fedcomp.app.client_app import app as client_app
    from fedcomp.protocol.messages import MODEL_STATE_KEY
    from fedcomp.run.inprocess_grid import InProcessGrid
    from fedcomp.strategies import CompressedStrategy
    from fedcomp.task.models import build_model

    logging.getLogger("flwr").setLevel(logging.WARNING)
    grid = InProcessGrid(client_app, 4, {"lr": 0.1})
    s = CompressedStrategy(FedAvg(fraction_train=0.5, min_train_nodes=2, min_available_nodes=4, fraction_evaluate=0.0),
                           compressor="randsign", density=0.25, downstream="randsign")
    arrays = ArrayRecord(build_model().state_dict())
    n = sum(int(np.prod(a.shape)) for a in arrays.values())
    kinds = []
    for rnd in range(1, 6):
        msgs = list(s.configure_train(rnd, arrays, ConfigRecord({"seed": 1}), grid))
        arrays, _ = s.aggregate_train(rnd, grid.send_and_receive(msgs))
        for m in msgs:
            node = m.metadata.dst_node_id
            held = grid.contexts[node].state[MODEL_STATE_KEY]
            flat = np.concatenate([a.numpy().ravel() for a in held.values()])
            assert np.array_equal(flat, s.downstream.held(node))
            kinds.append(s.downstream.sent_kind[node])
            if s.downstream.sent_kind[node] == "payload":
                assert 0.25 * n / 8 <= s.downstream.sent_bytes[node] < 0.26 * n / 8 + 600
    assert "payload" in kinds
