"""A download step that is a secure round's shared-projection sum: exact both sides, small, hostile bytes
refused, and sent only when it describes the new global model."""

import math

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from fedcomp.compression import PayloadError
from fedcomp.compression.shared_projection import SharedProjection
from fedcomp.config import CodecConfig
from fedcomp.download.layout import decode_step
from fedcomp.download.sender import Downstream
from fedcomp.download.shared_step import MAGIC, MAX_TABLE, SharedStep, decode

DIM = 3000


def _step(density=0.07, rotate=True, levels=81, factor=4.0, seed=11):
    proj = SharedProjection(DIM, density, seed, rotate)
    rng = np.random.default_rng(seed)
    grid = (np.arange(levels) - levels // 2) * (0.1 / levels)  # a quantized mean: few distinct values
    return SharedStep(proj, grid[rng.integers(0, levels, proj.k)], factor)


def test_a_shared_step_decodes_to_the_servers_update_bit_for_bit_in_a_few_bits_a_value():
    step = _step()
    segments = [(0, 1000), (1200, 1800)]
    payload = step.payload(segments)
    want = step.projection.decode(step.values) * step.factor  # what the secure strategy adds, float64
    got = decode(memoryview(payload), 2800)
    assert got.dtype == np.float32 and got.shape == (2800,)
    assert np.array_equal(got, np.concatenate([want[:1000], want[1200:]]).astype(np.float32))
    assert np.array_equal(decode_step(payload, [1000, 1800]), got)  # the download's decoder dispatches to it
    k = step.projection.k
    assert len(payload) <= math.ceil(k * 7 / 8) + 81 * 8 + 100  # 81 values: 7 bits an index, the table, a header


def test_values_off_a_grid_or_not_finite_give_no_shared_step():
    proj = SharedProjection(DIM, 0.5, 1, False)
    noisy = np.random.default_rng(0).normal(size=proj.k)  # DP noise: every value distinct
    assert SharedStep(proj, noisy, 1.0).payload([(0, DIM)]) is None
    assert SharedStep(proj, np.full(proj.k, np.nan), 1.0).payload([(0, DIM)]) is None
    assert SharedStep(proj, np.zeros(proj.k + 1), 1.0).payload([(0, DIM)]) is None
    assert SharedStep(proj, np.zeros(proj.k), 0.0).payload([(0, DIM)]) is None
    one = SharedStep(proj, np.zeros(proj.k), 1.0).payload([(0, DIM)])  # one distinct value: 1 bit each
    assert not decode(memoryview(one), DIM).any()
    assert MAX_TABLE == 256


def _patched(payload: bytes, offset: int, fmt: str, value) -> bytes:
    import struct

    out = bytearray(payload)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


@pytest.mark.parametrize("case, match", [
    ("truncated", "truncated"),
    ("trailing", "bytes of indices"),
    ("huge dim", "dim"),
    ("wrong k", "do not agree"),
    ("bad factor", "factor"),
    ("segments past n", "segments cover"),
    ("segment past dim", "past dim"),
    ("table nan", "not finite"),
    ("index past table", "index past"),
])
def test_hostile_shared_steps_are_refused(case, match):
    step = _step(levels=5)  # 5 values: 3-bit indices, 3 of them unused
    payload = step.payload([(0, DIM)])
    head = len(MAGIC)
    table_at = head + 45 + 16 + 2  # header, one segment, the table's size
    bad = {
        "truncated": payload[:20],
        "trailing": payload + b"\x00",
        "huge dim": _patched(payload, head, "<Q", 10**12),
        "wrong k": _patched(payload, head + 8, "<Q", step.projection.k + 1),
        "bad factor": _patched(payload, head + 32, "<d", float("inf")),
        "segments past n": payload,
        "segment past dim": _patched(payload, head + 45, "<Q", 5),
        "table nan": _patched(payload, table_at, "<d", float("nan")),
        "index past table": payload[:table_at + 40] + b"\xff" + payload[table_at + 41:],
    }[case]
    n = DIM - 1 if case == "segments past n" else DIM
    with pytest.raises(PayloadError, match=match):
        decode(memoryview(bad), n)


def _record(flat: np.ndarray) -> ArrayRecord:
    return ArrayRecord({"a": Array(flat[:1000].reshape(10, 100).copy()), "b": Array(flat[1000:].copy()),
                        "steps": Array(np.array(3, np.int64))})


def _sender_after_round_one(step: SharedStep, target_of):
    """A Downstream that sent the start (round 1) and now the step towards ``target_of(start, delta)``."""
    sender = Downstream(CodecConfig.from_kwargs("int8", True), "int8", init="dense")
    start = np.random.default_rng(1).normal(size=DIM).astype(np.float32)
    sender.prepare_nodes(1, _record(start), [1], [{}])
    sender.note_replies([{"node": 1}])
    delta = step.projection.decode(step.values) * step.factor
    target = target_of(start, delta)
    forms = sender.prepare_nodes(2, _record(target), [1], [{}], step=step)
    return sender, target, forms


def test_the_sender_sends_the_shared_step_when_it_describes_the_new_model():
    step = _step()
    sender, target, forms = _sender_after_round_one(
        step, lambda g, d: (g.astype(np.float64) + d).astype(np.float32))
    payload = sender.nodes.payloads[sender.version]
    assert payload[:4] == MAGIC and sender.sent_bytes[1] < 0.3 * DIM  # int8: DIM bytes and more
    assert np.abs(sender.broadcast - target).max() <= 1e-6 * np.abs(target).max()


def test_a_model_moved_otherwise_gets_the_codecs_step():
    """Server momentum (here: twice the step) moves the model away from the sum: int8's step, not the sum."""
    step = _step()
    sender, target, _ = _sender_after_round_one(
        step, lambda g, d: (g.astype(np.float64) + 2 * d).astype(np.float32))
    assert sender.nodes.payloads[sender.version][:4] != MAGIC
    assert np.abs(sender.broadcast - target).max() <= 0.02 * np.abs(target - sender.nodes.versions[1]).max()


def test_a_step_must_name_the_models_float_entries_and_one_segment_a_tensor():
    """Found by an attack round: without the node's layout a 1 MiB step could name a projection four times
    the model, or a segment per entry (a 7.6 MiB model part took 517 MiB to decode)."""
    step = _step()
    payload = step.payload([(0, 1000), (1200, 1800)])
    assert decode_step(payload, [1000, 1800], dim=DIM).shape == (2800,)
    with pytest.raises(PayloadError, match="dim 3000 for a model of 3001"):
        decode_step(payload, [1000, 1800], dim=DIM + 1)
    with pytest.raises(PayloadError, match="2 segments"):
        decode_step(payload, [2800], dim=DIM)  # one tensor: one segment at most
    empty = SharedStep(step.projection, step.values, step.factor).payload([(0, 0), (0, 2800)])
    with pytest.raises(PayloadError, match="empty"):
        decode_step(empty, [1000, 1800], dim=DIM)


def test_the_step_decodes_on_the_cpu_whatever_the_default_device():
    """Found by an attack round: an app that sets torch's default device (here "meta") made the projection's
    scatter land there."""
    step = _step()
    payload = step.payload([(0, DIM)])
    want = decode(memoryview(payload), DIM)
    torch.set_default_device("meta")
    try:
        got = decode(memoryview(payload), DIM)
    finally:
        torch.set_default_device("cpu")
    assert np.array_equal(got, want)


def test_a_step_that_is_not_a_shared_step_or_leaves_a_negative_variance_gets_the_codec():
    """The sender takes the codec's step for a hint of the wrong kind or one that does not fit (a struct
    error, a negative seed), and for a sum that would leave a BatchNorm running variance below 0 (nodes
    refuse it); the secure download refuses batchnorm-stats = 'codec' outright."""
    from fedcomp.download.secagg import SecAggDownload

    step = _step()
    bad = SharedStep(SharedProjection(DIM, 0.07, 11, True), step.values, step.factor)
    object.__setattr__(bad.projection, "seed", -1)  # what a buggy strategy could hand over
    sender, target, _ = _sender_after_round_one(bad, lambda g, d: (g.astype(np.float64) + d).astype(np.float32))
    assert sender.nodes.payloads[sender.version][:4] != MAGIC
    with pytest.raises(ValueError, match="batchnorm-stats = 'codec'"):
        SecAggDownload(Downstream(CodecConfig.from_kwargs("int8", True, batchnorm_stats="codec"), "int8"))


def test_a_sum_that_would_leave_a_negative_running_variance_gets_the_codecs_step():
    step = _step()
    sender = Downstream(CodecConfig.from_kwargs("int8", True, batchnorm_stats="codec"), "int8", init="dense")
    start = np.full(DIM, 1e-3, np.float32)

    def record(flat):
        return ArrayRecord({"a": Array(flat[:1000].copy()), "bn.running_var": Array(flat[1000:].copy())})

    sender.prepare_nodes(1, record(start), [1], [{}])
    sender.note_replies([{"node": 1}])
    target = np.maximum(start + step.projection.decode(step.values) * step.factor, 0).astype(np.float32)  # clamped
    sender.prepare_nodes(2, record(target), [1], [{}], step=step)
    assert sender.nodes.payloads[sender.version][:4] != MAGIC
