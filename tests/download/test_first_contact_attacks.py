"""A hostile or malformed first-contact message (the seeded start and the compressed start).

A client must refuse it with a :class:`PayloadError` / :class:`CompositionError` / ``ValueError``
naming the tensor, before building anything, and keep the copy it held: never an unhandled
``RuntimeError`` (torch), ``TypeError`` (numpy) or an allocation sized by the server's claim.
"""

import io
import struct

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedcomp.download.receiver import rebuild
from fedcomp.compression import PayloadError
from fedcomp.protocol.messages import MODEL_META_KEY, MODEL_STATE_KEY
from fedcomp.download.seeded_init import INIT_SEED, INIT_STYPE, parse_rule, seeded_tensor
from tests.messages import make_ctx, make_msg


def _rule(dtype: str, shape: tuple, *values: float) -> Array:
    return Array(dtype=dtype, shape=shape, stype=INIT_STYPE, data=struct.pack("<" + "d" * len(values), *values))


def _npy(a: np.ndarray, dtype: str | None = None) -> Array:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return Array(dtype=dtype or str(a.dtype), shape=a.shape, stype="numpy.ndarray", data=buf.getvalue())


def _receive(arrays: dict, ctx=None):
    rec = ArrayRecord(arrays)
    msg = make_msg(RecordDict({"arrays": rec, "config": ConfigRecord({"fedcomp-model-version": 2, INIT_SEED: 7})}))
    return rebuild(msg, ctx or make_ctx(), "arrays", rec, dict(msg.content["config"]))


def _held_ctx():
    ctx = make_ctx()
    _receive({"w": _rule("float32", (3,), 0.5)}, ctx)
    ctx.state[MODEL_META_KEY]["version"] = 1
    return ctx


@pytest.mark.parametrize("bound,center", [(1e300, 0.0), (3.5e38, 0.0), (2e38, 0.0), (1.0, 1e300), (0.0, -1e39)])
def test_a_rule_outside_float32_is_refused_naming_the_tensor(bound, center):
    """Values are drawn in float32: a bound whose range overflows float32 (torch raised RuntimeError)
    or a center beyond float32 is no rule."""
    with pytest.raises(ValueError, match="seeded-init rule of 'w'"):
        parse_rule("w", struct.pack("<dd", bound, center))
    with pytest.raises(ValueError, match="'w'"):
        seeded_tensor("w", (3,), bound, 1, center)
    ctx = _held_ctx()
    with pytest.raises(PayloadError, match="'w'"):
        _receive({"w": _rule("float32", (3,), bound, center)}, ctx)
    assert ctx.state[MODEL_META_KEY]["version"] == 1  # nothing lost: the held copy stays
    assert tuple(ctx.state[MODEL_STATE_KEY]["w"].shape) == (3,)


def test_the_largest_float32_rule_still_builds():
    out = seeded_tensor("w", (64,), 1.7e38, 1)
    assert np.isfinite(out).all() and float(np.abs(out).max()) <= 1.7e38


@pytest.mark.parametrize("shape", [(-1, 5), (5, -1), (-1, -(2**30)), (2**22, 2**22, 2**20), (2**32, 2**32)])
def test_a_rule_with_a_negative_or_overflowing_shape_is_refused_naming_the_tensor(shape):
    """Negative dimensions (torch: RuntimeError) and element counts that wrap around int64 in
    ``np.prod`` (then passed the element limit as 0) are refused before anything is allocated."""
    for bound in (0.0, 1.0):
        with pytest.raises(PayloadError, match="'w'"):
            _receive({"w": _rule("float32", shape, bound)})
    # a negative count must not make room for another tensor's claim either
    with pytest.raises(PayloadError):
        _receive({"a": _rule("float32", (-1, 2**30), 0.0), "w": _rule("float32", (2**27,), 1.0)})


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float128", "complex64", "object", "<f4"])
def test_a_rule_with_an_unknown_dtype_is_refused_naming_the_tensor(dtype):
    with pytest.raises(PayloadError, match="'w'"):
        _receive({"w": _rule(dtype, (3,), 1.0)})


@pytest.mark.parametrize("bad", [
    Array(dtype="float32", shape=(3,), stype="numpy.ndarray", data=b"garbage"),
    Array(dtype="float32", shape=(3,), stype="weird", data=b"\0" * 12),
    Array(dtype="float32", shape=(3,), stype="fedcomp.payload.v1", data=b"\0" * 12),
    _npy(np.zeros(3, np.complex64)),
])
def test_a_malformed_plain_array_in_a_first_contact_is_refused_naming_it(bad):
    """The tensors sent as plain arrays next to the rules (integer buffers, BatchNorm statistics)."""
    ctx = _held_ctx()
    with pytest.raises(PayloadError, match="'n'"):
        _receive({"w": _rule("float32", (3,), 1.0), "n": bad}, ctx)
    assert ctx.state[MODEL_META_KEY]["version"] == 1


def test_valid_edge_rules_still_build():
    out = _receive({"w": _rule("float16", (2, 3), 0.5, 1.0), "e": _rule("float32", (0, 3), 1.0),
                    "s": _rule("bfloat16", (), 0.0, 2.0), "d": _rule("float64", (4,), 1.0),
                    "n": _npy(np.arange(3, dtype=np.int64))})
    assert {k: tuple(a.shape) for k, a in out.items()} == {"w": (2, 3), "e": (0, 3), "s": (), "d": (4,), "n": (3,)}
    assert torch.equal(torch.from_numpy(out["n"].numpy()), torch.arange(3))


@pytest.mark.parametrize("downstream", [None, "stc"])
def test_a_client_cannot_set_the_download_bytes_of_the_round_line(downstream):
    """``download-bytes`` (the round line's MB down and the both-ways ratio in metrics.json) is what
    the server sent, not what a client reports: a client claiming -1e100 or 1e100 bytes made the
    run's both-ways ratio negative, None or ~0 when the download was not compressed."""
    from flwr.app import Message, MetricRecord
    from flwr.serverapp.strategy import FedAvg
    from torch import nn

    from fedcomp.app.client_app import app as client_app
    from fedcomp.client import compression_mod
    from fedcomp.run.inprocess_grid import InProcessGrid
    from fedcomp.statedict import to_record
    from fedcomp.strategies import CompressedStrategy

    torch.manual_seed(0)
    sd = nn.Linear(30, 20).state_dict()
    s = CompressedStrategy(FedAvg(fraction_evaluate=0.0, min_available_nodes=2, min_train_nodes=2),
                           compressor="stc", density=0.5, downstream=downstream)
    msgs = list(s.configure_train(1, to_record(sd), ConfigRecord({"seed": 1}), InProcessGrid(client_app, 2, {})))
    sent = {m.metadata.dst_node_id: sum(len(a.data) for a in m.content["arrays"].values()) for m in msgs}
    replies = []
    for i, m in enumerate(msgs):
        def handler(msg, ctx):
            trained = {k: t + 0.01 for k, t in sd.items()}
            return Message(content=RecordDict({"arrays": to_record(trained),
                                               "metrics": MetricRecord({"num-examples": 10})}), reply_to=msg)

        reply = compression_mod(m, make_ctx(node_id=m.metadata.dst_node_id), handler)
        assert not reply.has_error()
        reply.content["metrics"]["download-bytes"] = -1e100 if i == 0 else 1e100
        replies.append(reply)
    _, metrics = s.aggregate_train(1, replies)
    assert metrics["num-replies"] == 2
    assert s.history[1]["download-bytes"] == float(sum(sent.values()))


@pytest.mark.parametrize("name", ["fedadam", "fedavg-resnet-8e2956f"])
def test_resuming_a_checkpoint_older_than_both_ways_counting_keeps_the_ratio_honest(name):
    """A checkpoint without ``cum-dense-mb`` (or without ``cum-down-mb`` as well) in ``extra``, whose
    round records have ``dense-bytes`` and ``download-bytes``: the resumed run counts the earlier
    rounds' fp32 bytes both ways from them, so the both-ways ratio divides the whole run's fp32 bytes
    by the whole run's bytes."""
    import json
    import pathlib

    from fedcomp.app.recorder import RoundRecorder
    from fedcomp.app.results import MB

    meta = json.loads((pathlib.Path(__file__).parents[1] / "server" / "fixtures" / "checkpoints" / name /
                       "checkpoint.json").read_text())
    assert "cum-dense-mb" not in meta.get("extra", {})
    rec = object.__new__(RoundRecorder)  # restore() needs no test set
    rec.restore(meta)
    rounds = [r for r in meta["rounds"] if "dense-bytes" in r]
    assert rec.cum_dense_mb == pytest.approx(2 * sum(r["dense-bytes"] for r in rounds) / MB)
    assert rec.cum_down_mb == pytest.approx(sum(r["download-bytes"] for r in rounds) / MB)
    assert rec.totals()["cumulative-ratio-both-ways"] == pytest.approx(
        2 * sum(r["dense-bytes"] for r in rounds) / sum(r["upload-bytes"] + r["download-bytes"] for r in rounds))


@pytest.mark.parametrize("init", ["seeded", "auto"])
def test_exact_catch_up_after_a_seeded_or_compressed_start_stays_within_max_copies(init):
    """``catchup = "exact"`` kept every broadcast payload since B_1 for nodes not seen yet, whatever
    ``max_copies`` said (80 rounds of sign: 4.65 copies for a budget of 3, growing each round). Past
    the budget the chain from B_1 is let go: a late node gets the start and a compressed diff, and
    still holds what the server records for it."""
    from torch import nn

    from fedcomp.config import CodecConfig
    from fedcomp.statedict import to_record, to_state_dict
    from fedcomp.download.sender import Downstream

    torch.manual_seed(0)
    sd = nn.Sequential(nn.Linear(50, 40), nn.Linear(40, 10)).state_dict()
    ds = Downstream(CodecConfig(compressor="sign"), "sign", init=init, catchup="exact", max_copies=3)
    g = to_state_dict(ds.start_model(to_record(sd)))
    for r in range(1, 41):
        msg = make_msg(RecordDict({"arrays": to_record(g), "config": ConfigRecord({})}), dst=1)
        ds.prepare(r, to_record(g), [msg])
        ds.received(1)
        assert ds.nodes.copies() <= 3, r
        g = {k: t + 0.01 * torch.randn_like(t) for k, t in g.items()}
    late = make_msg(RecordDict({"arrays": to_record(g), "config": ConfigRecord({})}), dst=9)
    ds.prepare(41, to_record(g), [late])
    ctx = make_ctx(node_id=9)
    out = to_state_dict(rebuild(late, ctx, "arrays", late.content["arrays"], dict(late.content["config"])))
    ds.received(9)
    assert ds.sent_kind[9].startswith("init+")
    assert np.array_equal(ds.held(9), np.concatenate([out[k].numpy().reshape(-1) for k in out]))


def test_seeded_refuses_batchnorm_statistics_that_left_their_initialisation():
    """``"seeded"`` drew a moved running variance like any tensor: mean + uniform(+-sqrt(3) std) went
    negative ([1e-3] * 7 + [1e3]: 4 of 8 entries below 0) and the model's eval output was NaN. Fresh
    BatchNorm statistics (zeros, ones) stay exact as before."""
    from torch import nn

    from fedcomp.config import CodecConfig
    from fedcomp.statedict import to_record, to_state_dict
    from fedcomp.download.sender import Downstream

    m = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    fresh = to_state_dict(Downstream(CodecConfig(), "stc", init="seeded").start_model(to_record(m.state_dict())))
    assert torch.equal(fresh["1.running_var"], torch.ones(8)) and torch.equal(fresh["1.running_mean"], torch.zeros(8))
    sd = m.state_dict()
    sd["1.running_var"] = torch.tensor([1e-3] * 7 + [1e3])
    with pytest.raises(ValueError, match=r"downstream init 'seeded': BatchNorm statistics \['1.running_var'\]"):
        Downstream(CodecConfig(), "stc", init="seeded").start_model(to_record(sd))


@pytest.mark.parametrize("stype", [INIT_STYPE, "fedcomp.payload.v1"])
def test_rules_or_payloads_without_a_model_version_are_a_payload_error(stype):
    """Without ``fedcomp-model-version`` the record was passed on as dense weights and numpy raised
    ``TypeError: Unsupported serialization type`` inside compression_mod."""
    from flwr.app import Message, MetricRecord

    from fedcomp.client import compression_mod

    rec = ArrayRecord({"w": Array(dtype="float32", shape=(3,), stype=stype, data=struct.pack("<d", 1.0))})
    msg = make_msg(RecordDict({"arrays": rec, "config": ConfigRecord({INIT_SEED: 1})}))
    with pytest.raises(PayloadError, match="'fedcomp-model-version'.*'w'"):
        rebuild(msg, make_ctx(), "arrays", rec, dict(msg.content["config"]))
    with pytest.raises(PayloadError):
        compression_mod(msg, make_ctx(), lambda m, c: Message(RecordDict({"metrics": MetricRecord()}), reply_to=m))


@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, "7", True, None])
def test_a_seeded_init_whose_seed_no_client_accepts_is_refused_naming_it(seed):
    """Clients accept ``fedcomp-init-seed`` only as an integer in [0, 2**63) (Flower's int64 config
    values): a SeededInit with another seed was accepted by the server and every first contact of
    the run failed on the clients (CompositionError), or the config could not be sent at all."""
    from fedcomp.config import CodecConfig
    from fedcomp.download.seeded_init import SeededInit
    from fedcomp.download.sender import Downstream

    with pytest.raises(ValueError, match="downstream init: SeededInit seed must be an integer in"):
        Downstream(CodecConfig(), "stc", init=SeededInit(seed, {"w": 0.5}))
    assert Downstream(CodecConfig(), "stc", init=SeededInit(2**63 - 1, {"w": 0.5})).init.seed == 2**63 - 1


def _npy_claiming(shape: tuple) -> Array:
    """An npy array whose header claims ``shape`` but that holds 16 bytes of data."""
    from numpy.lib import format as npy_format

    buf = io.BytesIO()
    npy_format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": shape})
    buf.write(b"\0" * 16)
    return Array(dtype="float32", shape=shape, stype="numpy.ndarray", data=buf.getvalue())


@pytest.mark.parametrize("shape", [(10**12,), (10**8,)])
def test_an_npy_header_claiming_more_than_its_bytes_allocates_nothing(shape):
    """np.load allocates what a header claims before it reads: a ~100-byte array claiming 10**12
    float32 raised MemoryError (3.6 TiB) in the first contact's plain arrays and in any dense train
    message through compression_mod; 10**8 allocated 400 MB first."""
    from flwr.app import Message, MetricRecord

    from fedcomp.client import compression_mod
    from fedcomp.statedict import numpy_dict

    with pytest.raises(ValueError, match="claims"):
        numpy_dict(ArrayRecord({"n": _npy_claiming(shape)}))
    with pytest.raises(PayloadError, match="'n'"):
        _receive({"w": _rule("float32", (3,), 1.0), "n": _npy_claiming(shape)})
    msg = make_msg(RecordDict({"arrays": ArrayRecord({"n": _npy_claiming(shape)}), "config": ConfigRecord({})}))
    with pytest.raises(ValueError, match="claims"):
        compression_mod(msg, make_ctx(), lambda m, c: Message(RecordDict({"metrics": MetricRecord()}), reply_to=m))


@pytest.mark.parametrize("init,expected", [("auto", "seeded-lora"), ("dense", "dense"), ("fp16", "fp16")])
def test_the_lora_app_keeps_an_explicit_downstream_init(monkeypatch, tmp_path, init, expected):
    """With finetune = "lora" the server app replaced run config 'downstream-init' by the adapters'
    seeded start whatever it said: 'dense' or 'fp16' was silently ignored. Only 'auto' means the
    seeded start."""
    import fedcomp.app.server_app as sa
    from fedcomp.download.seeded_init import SeededInit

    seeded = SeededInit(3, {})
    got = {}

    class Stop(Exception):
        pass

    class Capture:
        @staticmethod
        def from_codec_config(inner, codec, **options):
            got.update(options)
            raise Stop

    monkeypatch.setattr(sa, "check_supernodes_fit_the_data", lambda *a, **k: None)
    monkeypatch.setattr(sa, "writable_results_dir", lambda *a, **k: tmp_path)
    monkeypatch.setattr(sa, "route_flower_logs", lambda *a, **k: None)
    monkeypatch.setattr(sa, "initial_adapters", lambda settings, seed: ({}, seeded))
    monkeypatch.setattr(sa, "build_inner", lambda cfg: None)
    monkeypatch.setattr(sa, "CompressedStrategy", Capture)
    rc = {"finetune": "lora", "dataset": "shakespeare", "model": "transformer", "base-model": str(tmp_path),
          "compressor": "sign", "downstream-init": init}

    class Grid:
        def get_node_ids(self):
            return [1, 2]

    from flwr.app import Context

    with pytest.raises(Stop):
        sa.main(Grid(), Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=rc))
    init = got["downstream"].init
    assert (init is seeded) if expected == "seeded-lora" else init == expected


@pytest.mark.parametrize("init", ["auto", "seeded", "dense", "int8"])
def test_a_non_finite_initial_model_is_refused_at_start_naming_the_tensor(init):
    """A NaN in the initial model failed in round 1 under ``"auto"`` (the int8 start's "input holds 1
    non-finite value(s)", no tensor named) and went out to every client under ``"dense"``; now the
    start refuses it under every policy, naming the tensor and the count."""
    from torch import nn

    from fedcomp.config import CodecConfig
    from fedcomp.statedict import to_record
    from fedcomp.download.sender import Downstream

    sd = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3), nn.Linear(3, 2)).state_dict()
    sd["1.weight"][0, :2] = torch.tensor([float("nan"), float("inf")])
    sd["2.bias"][0] = float("-inf")
    with pytest.raises(ValueError, match=r"tensor '1\.weight' holds 2 NaN/Inf entries \(1 more tensors too\)"):
        Downstream(CodecConfig(compressor="stc"), "stc", init=init).start_model(to_record(sd))
