"""A sign download sends one payload per tensor (its own scale), and a per-tensor step is refused
when its bytes do not fit the model the client holds."""

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, RecordDict

from fedcomp.download.receiver import rebuild
from fedcomp.compression import PayloadError, get_compressor
from fedcomp.config import CodecConfig
from fedcomp.download.layout import PER_TENSOR_MAGIC, decode_step, encode_per_tensor
from fedcomp.statedict import FlatModel, to_record

from tests.messages import make_msg
from tests.download.test_node_copies import SHAPES, Fed, _flat, _walk

SIGN = get_compressor("sign")


def _step(vec, sizes):
    return encode_per_tensor(lambda i, part: SIGN.compress(torch.from_numpy(part)), vec, sizes)


def test_a_per_tensor_step_decodes_to_each_tensors_own_scale():
    vec = np.concatenate([np.full(6, 1.0), np.full(0, 9.0), np.full(4, -0.001)]).astype(np.float32)
    step = _step(vec, [6, 0, 4])
    assert step.startswith(PER_TENSOR_MAGIC)
    assert len(step) == 8 + 2 * (4 + 22 + 1)  # count, then per tensor: length, header (scale), one byte of signs
    assert np.array_equal(decode_step(step, [6, 0, 4]), vec)  # one scale over both would be 0.6004 everywhere
    whole = SIGN.compress(torch.from_numpy(vec))  # a step of the whole vector still decodes
    assert np.allclose(decode_step(whole, [6, 0, 4]), np.where(vec > 0, 1, -1) * np.abs(vec).mean())


@pytest.mark.parametrize("mangle, match", [
    (lambda b: b[:6], "payloads for"),
    (lambda b: b[:4] + (3).to_bytes(4, "little") + b[8:], "3 payloads for 2 tensors"),
    (lambda b: b[:-1], "past the end"),
    (lambda b: b + b"\0", "after the last payload"),
    (lambda b: b[:10], "ends inside a length|past the end"),
])
def test_a_malformed_per_tensor_step_is_refused(mangle, match):
    step = _step(np.ones(10, np.float32), [6, 4])
    with pytest.raises(PayloadError, match=match):
        decode_step(mangle(step), [6, 4])


def test_a_per_tensor_step_for_other_tensor_sizes_is_refused():
    step = _step(np.ones(10, np.float32), [6, 4])
    with pytest.raises(PayloadError):
        decode_step(step, [4, 6])  # the same total, other tensors: each payload must fit its own tensor


def test_the_sign_download_scales_each_tensor_and_the_client_holds_what_the_server_records():
    """A LoRA-like model whose tensors change by different amounts: each tensor's change travels with
    its own scale (one scale over all of them sent the small tensor 10x its change; on the LoRA
    benchmark per-tensor scales kept more of fp32's gain), bit for bit what the server records."""
    init, seq = _walk(rounds=3)
    big, small = "q.lora_B.weight", "v.lora_A.weight"
    seq[1] = {k: v + (0.1 if k == big else 0.001 if k == small else 0.0) for k, v in seq[0].items()}
    fed = Fed("sign", 2, init=init)
    fed.round(seq[0], [0, 1])
    got = fed.round(seq[1], [0])
    assert fed.ds.per_tensor() and fed.ds.sent_kind[0] == "payload"
    payload = fed.ds.nodes.payloads[fed.ds.version]
    assert payload.startswith(PER_TENSOR_MAGIC)
    assert len(payload) == 8 + len(SHAPES) * (4 + 22 + 256 // 8)
    for k in (big, small):  # every entry moved by exactly its tensor's own change
        assert np.allclose(got[0][k].numpy() - seq[0][k], seq[1][k] - seq[0][k], atol=1e-6)
    assert np.array_equal(_flat(got[0]), fed.ds.held(0))


def test_selection_model_keeps_one_payload_and_sparse_codecs_stay_whole():
    init, seq = _walk(rounds=2)
    fed = Fed("sign", 1, init=init, selection="model")
    fed.round(seq[0], [0])
    fed.round(seq[1], [0])
    assert not fed.ds.per_tensor() and not fed.ds.nodes.payloads[2].startswith(PER_TENSOR_MAGIC)
    stc = Fed("stc", 1, init=init, density=0.05)
    stc.round(seq[0], [0])
    stc.round(seq[1], [0])
    assert not stc.ds.per_tensor() and not stc.ds.nodes.payloads[2].startswith(PER_TENSOR_MAGIC)
    int8 = Fed("int8", 1, init=init, selection="tensor")  # asked for: any codec per tensor
    int8.round(seq[0], [0])
    got = int8.round(seq[1], [0])
    assert int8.ds.nodes.payloads[2].startswith(PER_TENSOR_MAGIC)
    assert np.array_equal(_flat(got[0]), int8.ds.held(0))
    assert CodecConfig().selection == "auto"


@pytest.mark.parametrize("codec, shared", [("stc", True), ("sign", True), ("int8", False)])
def test_new_nodes_with_the_same_start_share_one_encoded_diff(codec, shared, monkeypatch):
    """Nodes that build the same start (or hold the same version) get ``C(G - base)`` encoded once a
    round when the codec draws nothing from its seed: the same bytes for each (1000 nodes, 10 % a
    round: ~100 whole-model encodes a round were one); a seeded codec still draws per node. Every
    node's copy is what the server records, bit for bit."""
    init, seq = _walk(rounds=3)
    fed = Fed(codec, 8, init=init, density=0.1)
    fed.round(seq[0], [0])
    fed.round(seq[1], [0])
    calls = []
    real = type(fed.ds)._compress
    monkeypatch.setattr(type(fed.ds), "_compress", lambda self, *a, **k: calls.append(a[2] if len(a) > 2 else None)
                        or real(self, *a, **k))
    got = fed.round(seq[2], list(range(8)))  # node 0 holds the last version; 1-7 are new
    assert [fed.ds.sent_kind[n] for n in range(1, 8)] == ["init+diff"] * 7
    sent = {fed.ds.sent_bytes[n] for n in range(1, 8)}
    diffs = [m for m in calls if m is not None]  # per-node encodes (the broadcast has node None)
    assert len(diffs) == (1 if shared else 7) and len(sent) == 1
    for n in range(8):
        assert np.array_equal(_flat(got[n]), fed.ds.held(n))

def test_a_per_tensor_payload_of_float64_values_is_refused():
    """A ``none`` payload of float64 values (1e300) per tensor: refused, not cast to float32's inf."""
    wide = get_compressor("none").compress(torch.full((6,), 1e300, dtype=torch.float64))
    parts = [wide, SIGN.compress(torch.ones(4))]
    step = PER_TENSOR_MAGIC + len(parts).to_bytes(4, "little") + b"".join(
        len(p).to_bytes(4, "little") + p for p in parts)
    with pytest.raises(PayloadError, match="float64, not float32"):
        decode_step(step, [6, 4])


@pytest.mark.parametrize("codec", ["sign", "int8"])
@pytest.mark.parametrize("dtypes", [("float64", "float64"), ("float16", "float32", "bfloat16", "float64")])
def test_a_model_with_a_float64_tensor_holds_what_the_server_records(codec, dtypes):
    """A float64 model (and float32 tensors next to a float64 one) after a compressed start: the
    server's record was float32 (start) or unrounded float32 tensors, the client's copy not."""
    g = torch.Generator().manual_seed(0)
    shapes = [(8, 8), (6,), (5,), (4,)]
    seq = [{f"t{i}": torch.randn(shapes[i], generator=g).to(getattr(torch, d)) for i, d in enumerate(dtypes)}]
    for _ in range(3):
        seq.append({k: (v.double() + 0.01 * torch.randn(v.shape, generator=g, dtype=torch.float64)).to(v.dtype)
                    for k, v in seq[-1].items()})
    fed = Fed(codec, 1, init="auto")
    for r, w in enumerate(seq):
        fed.rnd += 1
        rec = to_record({k: v.clone() for k, v in w.items()})
        msg = make_msg(RecordDict({"arrays": rec, "config": ConfigRecord({"server-round": fed.rnd})}), dst=0)
        fed.ds.prepare(fed.rnd, rec, [msg])
        got = rebuild(msg, fed.ctx[0], "arrays", msg.content["arrays"], dict(msg.content["config"]))
        fed.ds.received(0)
        assert fed.ds.sent_kind[0] == ("init" if r == 0 else "payload")
        assert np.array_equal(FlatModel.from_record(got).flat, fed.ds.held(0))


def test_the_copy_budget_counts_a_float64_models_copies_at_8_bytes_an_entry():
    """A model with a float64 tensor keeps float64 copies: the 256 MiB floor holds half as many."""
    from flwr.app import ConfigRecord, RecordDict

    from fedcomp.statedict import to_record
    from fedcomp.download.sender import Downstream
    from fedcomp.download.node_copies import COPY_BYTES_FLOOR
    from tests.messages import make_msg

    budgets = {}
    for dtype in (torch.float32, torch.float64):
        ds = Downstream(CodecConfig(compressor="sign"), "sign")
        rec = to_record({"w": torch.zeros(1000, dtype=dtype), "b": torch.zeros(24, dtype=torch.float32)})
        ds.prepare(1, rec, [make_msg(RecordDict({"arrays": rec, "config": ConfigRecord({"server-round": 1})}), dst=0)])
        budgets[dtype] = ds.nodes.copy_budget()
    assert budgets[torch.float32] == COPY_BYTES_FLOOR / (4 * 1024)
    assert budgets[torch.float64] == COPY_BYTES_FLOOR / (8 * 1024)
