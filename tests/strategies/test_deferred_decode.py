"""Dense payloads of large tensors are validated at decode time, then kept as their bytes and decoded
again as they are folded (fedcomp.strategies.decode.DeferredPart): the running sum is bit for bit the
one of eagerly decoded replies, a bad payload is still refused before anything is folded, and a
decoded reply no longer holds its dense float32 update (sign: the server's peak)."""

import tracemalloc

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord

import fedcomp.compression as fc
import fedcomp.strategies.decode as decode
from fedcomp.client.update import compress_update
from fedcomp.compression import PayloadError
from fedcomp.config import CodecConfig
from fedcomp.protocol.messages import payload_array
from fedcomp.statedict import FlatModel
from fedcomp.strategies.aggregate import RunningSum

BIG = (300, 300)  # 90,000 entries >= DEFER_MIN_NUMEL


def _model(rng):
    return {"conv.weight": rng.standard_normal((8, 3, 3, 3)).astype(np.float32),
            "bn.weight": rng.standard_normal(8).astype(np.float32),
            "bn.bias": rng.standard_normal(8).astype(np.float32),
            "bn.running_mean": rng.standard_normal(8).astype(np.float32),
            "bn.running_var": rng.random(8).astype(np.float32), "bn.num_batches_tracked": np.array(3, np.int64),
            "scale": np.array(2.0, np.float32), "fc.weight": rng.standard_normal(BIG).astype(np.float32),
            "fc.bias": rng.standard_normal(300).astype(np.float32)}


def _record(g, codec, seed):
    rng = np.random.default_rng(seed)
    t = {k: (v + (0.1 * rng.standard_normal(v.shape)).astype(np.float32) if v.dtype.kind == "f" else v + 1)
         for k, v in g.items()}
    payloads, _, _ = compress_update(g, t, codec, {}, seed=seed)
    return ArrayRecord({k: payload_array(p) for k, p in payloads.items()})


@pytest.mark.parametrize("codec", [CodecConfig(compressor="sign"), CodecConfig(compressor="int8"),
                                   CodecConfig(compressor="none")], ids=["sign", "int8-per-tensor", "none"])
def test_the_running_sum_of_deferred_parts_is_bit_identical_to_eager_decoding(codec, monkeypatch):
    g = _model(np.random.default_rng(0))
    model = FlatModel.from_numpy(g)
    records = [_record(g, codec, seed) for seed in range(3)]
    lazy = [decode.decode_reply(r, model) for r in records]
    assert all(len(u.deferred) == 1 and u.deferred[0].segments[0][1] == model.offsets["fc.weight"] for u in lazy)
    monkeypatch.setattr(decode, "DEFER_MIN_NUMEL", 1 << 60)  # nothing deferred: the values held decoded
    eager = [decode.decode_reply(r, model) for r in records]
    assert all(not u.deferred for u in eager)
    sums = []
    for updates in (lazy, eager):
        running = RunningSum(model)
        for i, u in enumerate(updates):
            running.add(u, 10.0 + 7 * i)
        sums.append(running.flat())
    # the fold as it was written before its float64 scratch: acc += factor * values.astype(float64)
    ref = np.zeros(model.num_float, np.float64)
    for i, u in enumerate(eager):
        for start, vals in u.dense:
            ref[start: start + vals.size] += (10.0 + 7 * i) * vals.astype(np.float64)
        for pos, vals in u.sparse:
            ref[pos] += (10.0 + 7 * i) * vals.astype(np.float64)
    assert sums[0].tobytes() == sums[1].tobytes() == ref.tobytes()
    for a, b in zip(lazy, eager):
        assert a.sq_norm() == b.sq_norm()
        assert a.to_flat(model.num_float).tobytes() == b.to_flat(model.num_float).tobytes()


def test_a_deferred_payload_that_is_not_finite_on_the_global_model_is_refused_at_decode():
    g = _model(np.random.default_rng(1))
    g["fc.weight"][7, 7] = 2e38  # + a sign scale of 1.5e38 leaves float32
    model = FlatModel.from_numpy(g)
    rec = _record(g, CodecConfig(compressor="sign"), 0)
    rec["fc.weight"] = payload_array(fc.get_compressor("sign").compress(torch.full(BIG, 1.5e38)))
    with pytest.raises(PayloadError, match="'fc.weight': global \\+ update is not finite in the model's dtype float32"):
        decode.decode_reply(rec, model)


def test_a_decoded_sign_reply_holds_no_dense_update():
    g = _model(np.random.default_rng(2))
    model = FlatModel.from_numpy(g)
    rec = _record(g, CodecConfig(compressor="sign"), 0)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        update = decode.decode_reply(rec, model)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    dense_bytes = 4 * model.num_float
    assert len(update.deferred) == 1
    # only the small tensors stay decoded (1,025 entries of 91,549): well under a tenth of the update
    assert held < 0.1 * dense_bytes, (held, dense_bytes)


def test_the_fold_decodes_deferred_payloads_into_one_reused_buffer():
    """RunningSum decodes every deferred payload into one float32 buffer (``decompress(out=...)``):
    the first reply's fold allocates it, the next ones allocate nothing of the tensor's size
    (no per-reply copy of the model); the fold's own cache-sized temporaries are the same in both."""
    g = _model(np.random.default_rng(3))
    model = FlatModel.from_numpy(g)
    updates = [decode.decode_reply(_record(g, CodecConfig(compressor="sign"), seed), model) for seed in range(3)]
    running = RunningSum(model)
    running.add(updates[0], 1.0)
    peaks = []
    for u in updates[1:]:
        tracemalloc.start()
        try:
            if not peaks:
                running._decoded = None  # as if this were the first reply
            running.add(u, 1.0)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    assert peaks[1] <= peaks[0] - 0.9 * 4 * BIG[0] * BIG[1]
