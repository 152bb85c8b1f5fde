"""Every form of download (plain dense weights, versioned dense weights, a first contact, payloads on the
held copy; train or evaluate) passes one check in ``compression_mod`` before the app sees the model:
finite float tensors, BatchNorm running variances >= 0, a model version above the held one. A refusal is
one PayloadError naming the tensor or the version; the app is not called and the held copy is kept."""

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedcomp.client import compression_mod
from fedcomp.compression import PayloadError, encode_exact, get_compressor
from fedcomp.protocol.messages import BASE_VERSION, MODEL_META_KEY, MODEL_STATE_KEY, MODEL_VERSION, payload_array
from fedcomp.download.seeded_init import INIT_SEED, INIT_STYPE
from tests.messages import make_ctx, make_msg

#: A model with a BatchNorm running variance and an integer buffer.
MODEL = {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3), "1.running_var": np.ones(4, np.float32),
         "1.num_batches_tracked": np.array(3, np.int64)}


def _dense(**changed) -> dict:
    return {k: Array(np.array(changed.get(k, v), copy=True)) for k, v in MODEL.items()}


def _rule(bound: float, center: float = 0.0) -> Array:
    return Array(dtype="float32", shape=(4,), stype=INIT_STYPE, data=np.array([bound, center], "<f8").tobytes())


def _payload(step: np.ndarray) -> dict:
    """Payloads on the held copy: one ``none`` payload of the whole float vector (w, then running_var)."""
    return {"fedcomp.model": payload_array(get_compressor("none").compress(torch.from_numpy(step)))}


def _msg(arrays: dict, message_type: str = "train", **cfg):
    config = ConfigRecord({"server-round": 3, "compressor": "none", **cfg})
    return make_msg(RecordDict({"arrays": ArrayRecord(arrays), "config": config}), message_type=message_type)


def _echo(msg, ctx):
    return msg.create_reply(RecordDict({"arrays": msg.content["arrays"],
                                        "metrics": MetricRecord({"num-examples": 1})}))


def _holding(version: int = 2):
    """A node that holds the model at ``version`` (a dense download it trained on)."""
    ctx = make_ctx()
    compression_mod(_msg(_dense(), **{MODEL_VERSION: version}), ctx, _echo)
    assert ctx.state[MODEL_META_KEY]["version"] == version
    return ctx


def _copy(ctx) -> dict:
    return {k: bytes(a.data) for k, a in ctx.state[MODEL_STATE_KEY].items()}


NAN = MODEL["w"].copy()
NAN[1, 2] = np.nan
NEGATIVE_VAR = np.array([1.0, -1.95, 0.5, 1.0], np.float32)
BACK = {MODEL_VERSION: 1, BASE_VERSION: 2}

CASES = {
    "dense holding NaN": (_dense(w=NAN), {MODEL_VERSION: 3}, r"'w' holds 1 non-finite values"),
    "dense with a negative running_var": (_dense(**{"1.running_var": NEGATIVE_VAR}), {MODEL_VERSION: 3},
                                          (r"'1\.running_var' is a running variance with negative entries "
                                           r"\(min -1\.95\)")),
    "first contact with a negative running_var": (
        {**_dense(**{"1.running_var": NEGATIVE_VAR}), "w": Array(dtype="float32", shape=(4, 3), stype=INIT_STYPE,
                                                                  data=np.array([0.5], "<f8").tobytes())},
        {MODEL_VERSION: 3, INIT_SEED: 7}, r"'1\.running_var' is a running variance with negative entries"),
    "first contact whose rule draws a negative running_var": (
        {**_dense(), "1.running_var": _rule(0.5, -1.0)}, {MODEL_VERSION: 3, INIT_SEED: 7},
        r"'1\.running_var' is a running variance with negative entries \(min -1\.[0-5]"),
    "payload that takes running_var below zero": (
        _payload(np.concatenate([np.zeros(12), np.full(4, -3.0)]).astype(np.float32)),
        {MODEL_VERSION: 3, BASE_VERSION: 2},
        r"'1\.running_var' is a running variance with negative entries \(min -2\)"),
    "payloads overflowing float32": (
        {**_payload(np.full(16, 3e38, np.float32)),
         "fedcomp.model/1": _payload(np.full(16, 3e38, np.float32))["fedcomp.model"]},
        {MODEL_VERSION: 3, BASE_VERSION: 2}, r"'w' holds 12 non-finite values"),
    "payload whose version goes back (2 -> 1)": (_payload(np.zeros(16, np.float32)), BACK,
                                                 (r"'fedcomp-model-version' = 1 is not newer than the model "
                                                  r"version this node holds \(2\)")),
    "no step whose version moves (2 -> 3)": ({"1.num_batches_tracked": _dense()["1.num_batches_tracked"]},
                                            {MODEL_VERSION: 3, BASE_VERSION: 2}, r"carries no step between them"),
    "payload whose version stays (2 -> 2)": (_payload(np.zeros(16, np.float32)), {MODEL_VERSION: 2, BASE_VERSION: 2},
                                             r"carries steps but its version \(2\) is its base's"),
    "dense whose version goes back (2 -> 1)": (_dense(), {MODEL_VERSION: 1}, r"= 1 is not newer .* holds \(2\)"),
}


def test_a_first_contact_from_a_server_that_started_over_replaces_the_copy():
    """A restarted server counts its versions from 1 again and sends every node a first contact: it replaces
    the copy whatever version the node held (a replayed one cannot be folded: the server counts only replies
    to the round's messages)."""
    ctx = _holding(2)
    start = {**_dense(), "w": Array(dtype="float32", shape=(4, 3), stype=INIT_STYPE,
                                   data=np.array([0.5], "<f8").tobytes())}
    reply = compression_mod(_msg(start, **{MODEL_VERSION: 1, INIT_SEED: 7}), ctx, _echo)
    assert not reply.has_error() and ctx.state[MODEL_META_KEY]["version"] == 1


@pytest.mark.parametrize("message_type", ["train", "evaluate"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_download_is_refused_before_the_app_runs_and_the_copy_is_kept(case, message_type):
    arrays, cfg, why = CASES[case]
    ctx = _holding(2)
    before = _copy(ctx)
    called = []
    with pytest.raises(PayloadError, match=why):
        compression_mod(_msg(arrays, message_type, **cfg), ctx, lambda m, c: called.append(m))
    assert called == []
    assert _copy(ctx) == before and ctx.state[MODEL_META_KEY]["version"] == 2


def test_plain_dense_weights_holding_nan_are_refused_before_training():
    """Without the download's version keys (CompressedStrategy with a dense download): the same checks."""
    ctx = make_ctx()
    called = []
    with pytest.raises(PayloadError, match=r"^downloaded model: 'w' holds 1 non-finite values \(NaN or Inf\)"):
        compression_mod(_msg(_dense(w=NAN)), ctx, lambda m, c: called.append(m))
    assert called == [] and MODEL_STATE_KEY not in ctx.state
    with pytest.raises(PayloadError, match=r"'1\.running_var' is a running variance with negative entries"):
        compression_mod(_msg(_dense(**{"1.running_var": NEGATIVE_VAR})), ctx, lambda m, c: called.append(m))
    assert called == []


@pytest.mark.parametrize("form", ["dense", "first contact", "payload"])
def test_a_good_download_of_each_form_replaces_the_copy(form):
    """The control: the same forms with valid values pass and become the copy at their version (a zero
    running variance is a variance)."""
    ctx = _holding(2)
    zero_var = np.array([1.0, 0.0, 2.0, 1.0], np.float32)
    arrays, cfg = {"dense": (_dense(**{"1.running_var": zero_var}), {MODEL_VERSION: 3}),
                   "first contact": ({**_dense(), "1.running_var": _rule(0.5, 1.0)}, {MODEL_VERSION: 3, INIT_SEED: 7}),
                   "payload": (_payload(np.concatenate([np.zeros(12), zero_var - 1]).astype(np.float32)),
                               {MODEL_VERSION: 3, BASE_VERSION: 2})}[form]
    seen = []
    compression_mod(_msg(arrays, **cfg), ctx, lambda m, c: (seen.append(m.content["arrays"]), _echo(m, c))[1])
    assert len(seen) == 1 and ctx.state[MODEL_META_KEY]["version"] == 3
    var = seen[0]["1.running_var"].numpy()
    if form == "first contact":
        assert 0.5 <= float(var.min()) and float(var.max()) <= 1.5
    else:
        assert var.tolist() == zero_var.tolist()


@pytest.mark.parametrize("message_type", ["train", "evaluate"])
def test_a_message_without_a_step_on_the_held_version_gives_the_app_the_held_copy(message_type):
    """The server sends a node that holds the latest broadcast no step (the global model did not change since):
    the app gets the held copy, with the exact tensors the message carries; a replay of it changes nothing."""
    ctx = _holding(2)
    before = _copy(ctx)
    seen = []

    def app(msg, context):
        seen.append({k: np.array(a.numpy(), copy=True) for k, a in msg.content["arrays"].items()})
        return _echo(msg, context)

    held = {"1.num_batches_tracked": payload_array(encode_exact(np.array(9, np.int64)))}  # as the server sends it
    for _ in range(2):
        compression_mod(_msg(dict(held), message_type, **{MODEL_VERSION: 2, BASE_VERSION: 2}), ctx, app)
    assert len(seen) == 2 and all(np.array_equal(s["w"], MODEL["w"]) for s in seen)
    assert all(int(s["1.num_batches_tracked"]) == 9 for s in seen)
    assert ctx.state[MODEL_META_KEY]["version"] == 2
    assert {k: v for k, v in _copy(ctx).items() if k != "1.num_batches_tracked"} == {
        k: v for k, v in before.items() if k != "1.num_batches_tracked"}


def test_dense_weights_at_the_held_version_replace_the_copy():
    """The server forgot a node that holds version 2 (its evaluate reply was lost) and sends the round's model
    dense at that version: the node takes it (its copy becomes that model), as after a first contact."""
    ctx = _holding(2)
    changed = MODEL["w"] + 1.0
    seen = []
    compression_mod(_msg(_dense(w=changed), **{MODEL_VERSION: 2}), ctx,
                    lambda msg, c: seen.append(msg.content["arrays"]["w"].numpy()) or _echo(msg, c))
    assert len(seen) == 1 and np.array_equal(seen[0], changed)
    assert ctx.state[MODEL_META_KEY]["version"] == 2
    assert np.array_equal(ctx.state[MODEL_STATE_KEY]["w"].numpy(), changed)
