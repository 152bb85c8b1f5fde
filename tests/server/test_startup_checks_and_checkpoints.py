"""Regression tests for issue 14 (attack review): infinite config values, shared message records
in the in-process grid, torn checkpoints, resume with another codec."""

import dataclasses
import math

import pytest

from fedcomp.config import AppConfig, CodecConfig


def _float_keys(cls) -> list[str]:
    return [f.name.replace("_", "-") for f in dataclasses.fields(cls) if f.type == "float"]


FLOAT_KEYS = _float_keys(AppConfig) + _float_keys(CodecConfig)


def test_every_float_key_is_found():
    # The enumeration must see the keys the issue names (and every other float key).
    assert {"lr", "server-lr", "dirichlet-alpha", "density", "target-delta", "round-timeout"} <= set(FLOAT_KEYS)


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_float_values_are_refused_at_start_up_naming_the_key(key, value):
    with pytest.raises(ValueError, match=f"run config '{key}' must be a finite number"):
        AppConfig.from_run_config({key: value})


@pytest.mark.parametrize("key", ["lr", "server-lr", "dirichlet-alpha"])
def test_large_finite_rates_are_still_accepted(key):
    cfg = AppConfig.from_run_config({key: 1e30})
    assert getattr(cfg, key.replace("-", "_")) == 1e30


def test_in_process_grid_gives_each_message_its_own_records():
    # Issue 14 item 9: a handler that edits its incoming record must change nothing another client
    # (or the server) sees; before, clients started from models summing to [0, 10, 20, 30].
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from fedcomp.simulation import InProcessGrid

    app = ClientApp()
    seen = []

    @app.train()
    def train(msg, ctx):
        arrays, cfg = msg.content["arrays"], msg.content["config"]
        w = arrays["w"].numpy()
        seen.append((float(w.sum()), cfg.get("edited")))
        arrays["w"] = Array(w + 10.0)  # the hostile/buggy part: edit the incoming record in place
        cfg["edited"] = True
        msg.content["extra"] = ConfigRecord({"x": 1})
        return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

    grid = InProcessGrid(app, 4, {})
    shared = RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(3, np.float32))}),
                         "config": ConfigRecord({"server-round": 1})})
    msgs = [grid.create_message(shared, "train", nid, "1") for nid in grid.get_node_ids()]
    replies = list(grid.send_and_receive(msgs))
    assert seen == [(0.0, None)] * 4
    assert float(shared["arrays"]["w"].numpy().sum()) == 0.0 and "edited" not in shared["config"]
    assert set(shared.keys()) == {"arrays", "config"}
    assert [float(r.content["arrays"]["w"].numpy().sum()) for r in replies] == [30.0] * 4
    assert all(r.metadata.reply_to_message_id == m.metadata.message_id for r, m in zip(replies, msgs))


# -- Item 5: a checkpoint is one atomic unit; every array keeps its shape and dtype ------------------

def _zoo():
    import numpy as np

    return {"scale": np.array(0.5, np.float32), "num_batches_tracked": np.array(7, np.int64),
            "lut": np.arange(6, dtype=np.uint8).reshape(2, 3), "mask": np.array([True, False, True]),
            "half": np.array([1.5, -2.0], np.float16), "empty": np.zeros((0, 5), np.float32)}


def test_checkpoint_keeps_every_shape_and_dtype(tmp_path):

    import numpy as np

    from fedcomp.server import checkpoint

    zoo = _zoo()
    checkpoint.save(tmp_path, 3, zoo, None, [{"round": 3}])
    rnd, back, _ = checkpoint.load(tmp_path, None, {k: v.shape for k, v in zoo.items()})
    assert rnd == 3 and list(back) == list(zoo)
    for k, v in zoo.items():
        assert back[k].shape == v.shape and back[k].dtype == v.dtype, k
        np.testing.assert_array_equal(back[k], v)
    assert back["scale"].shape == () and back["num_batches_tracked"].shape == ()


def test_a_crash_between_the_two_files_leaves_a_pair_that_is_refused(tmp_path, monkeypatch):
    import os

    import numpy as np

    from fedcomp.server import checkpoint

    s = None
    checkpoint.save(tmp_path, 1, {"w": np.zeros(4, np.float32)}, s, [{"round": 1}])
    real, calls = os.replace, []

    def crash_on_the_manifest(src, dst):
        calls.append(str(dst))
        if str(dst).endswith(checkpoint.META):
            raise KeyboardInterrupt("killed")  # the server dies after the weights file was replaced
        real(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_the_manifest)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, 2, {"w": np.ones(4, np.float32)}, s, [{"round": 1}, {"round": 2}])
    monkeypatch.setattr(os, "replace", real)
    assert calls[0].endswith(checkpoint.WEIGHTS)
    with pytest.raises(ValueError, match=r"torn checkpoint .* holds round 2 .* written for round 1"):
        checkpoint.load(tmp_path, s)


def test_a_checkpoint_without_a_checksum_or_with_an_edited_weights_file_is_refused(tmp_path):
    import json

    import numpy as np

    from fedcomp.server import checkpoint

    s = None
    checkpoint.save(tmp_path, 1, {"w": np.zeros(4, np.float32)}, s, [{"round": 1}])
    meta = json.loads((tmp_path / checkpoint.META).read_text())
    np.savez(tmp_path / checkpoint.WEIGHTS, **{"w/w": np.ones(4, np.float32)})  # same round, other weights
    with pytest.raises(ValueError, match="torn checkpoint .* holds another round"):
        checkpoint.load(tmp_path, s)
    del meta[checkpoint.CHECKSUM]
    (tmp_path / checkpoint.META).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="has no 'weights-sha256'"):
        checkpoint.load(tmp_path, s)


# -- Item 6: resume with another codec is refused, naming the setting --------------------------------

def test_resume_with_another_codec_is_refused_naming_the_setting(tmp_path):
    import json

    from flwr.app import Context, RecordDict

    from fedcomp.client.app import app as client_app
    from fedcomp.server.app import main
    from fedcomp.simulation import InProcessGrid

    def run(rc):
        main(InProcessGrid(client_app, 2, rc), Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                                                       run_config=rc))

    base = {"results-dir": str(tmp_path), "client-state-dir": str(tmp_path / "s"), "compressor": "stc",
            "density": 0.05}
    run({**base, "num-server-rounds": 1})
    before = (tmp_path / "metrics.json").read_text()
    with pytest.raises(ValueError, match=r"codec settings differ .*'compressor' = 'sign' \(checkpoint: 'stc'\)"):
        run({**base, "num-server-rounds": 2, "resume": True, "compressor": "sign"})
    with pytest.raises(ValueError, match=r"'density' = 0.1 \(checkpoint: 0.05\)"):
        run({**base, "num-server-rounds": 2, "resume": True, "density": 0.1})
    assert (tmp_path / "metrics.json").read_text() == before  # the recorded history is untouched
    run({**base, "num-server-rounds": 2, "resume": True})
    rounds = json.loads((tmp_path / "metrics.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]


# -- Item 8: fp16 residual saturation reaches the client metrics, metrics.json and the log -----------

def test_fp16_residual_saturation_is_reported_and_warned_once_per_client(caplog):
    import logging

    import numpy as np
    from flwr.serverapp.strategy import FedAvg

    from fedcomp.client import compression_mod
    from fedcomp.statedict import FlatModel
    from fedcomp.strategies import CompressedStrategy

    from tests.messages import make_ctx, reply_with, train_msg

    g = {"w": np.zeros(1000, np.float32)}
    t = {"w": np.full(1000, 2e4, np.float32)}  # an update of 2e4 per entry, every round
    codec = {"compressor": "topk", "density": 0.01, "residual-dtype": "fp16"}
    ctx = make_ctx(node_id=4242)
    got = []
    with caplog.at_level(logging.WARNING, logger="flwr"):
        for _ in range(5):
            reply = compression_mod(train_msg(g, codec, dst=4242), ctx, lambda m, c: reply_with(m, t))
            got.append(reply.content["metrics"]["residual-saturated"])
    # Top-k sends 10 entries a round; the other residuals grow by 2e4 a round and pass 65504 in
    # round 4 (8e4): 970 entries hold 8e4 there, 10 of them are sent, 960 saturate.
    assert got[:3] == [0.0, 0.0, 0.0] and got[3] == 960.0 and got[4] > 0
    warned = [r for r in caplog.records if "saturated" in r.getMessage() and "4242" in r.getMessage()]
    assert len(warned) == 1 and "960 entries" in warned[0].getMessage()
    loss = (960 * (8e4 - 65504) ** 2 / (970 * 8e4**2 + 10 * (6e4**2 + 4e4**2 + 2e4**2))) ** 0.5
    assert f"{100 * loss:.1f} %" in warned[0].getMessage()

    # ... and the server sums it per round (the value metrics.json records).
    s = CompressedStrategy(FedAvg(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1),
                           compressor="topk", density=0.01)
    s.remember(1, FlatModel.from_numpy({"w": g["w"]}))
    replies = []
    for node in (1, 2):
        c = make_ctx(node_id=node)
        c.state = ctx.state  # the saturated residual of round 4
        replies.append(compression_mod(train_msg(g, codec, dst=node), c, lambda m, c_: reply_with(m, t)))
    _, metrics = s.aggregate_train(1, replies)
    assert metrics["residual-saturated"] == sum(r.content["metrics"]["residual-saturated"] for r in replies) > 0
    assert s.history[1]["residual-saturated"] == metrics["residual-saturated"]


def test_a_batchnorm_model_resumes_with_its_integer_buffers(tmp_path):
    # 0-d int64 num_batches_tracked through checkpoint and resume (before: saved as shape (1,) and
    # refused on resume as "does not fit the model"). Bit-exact resume is test_resume's (cnn).
    import json

    import numpy as np
    from flwr.app import Context, RecordDict

    from fedcomp.client.app import app as client_app
    from fedcomp.server import checkpoint
    from fedcomp.server.app import main
    from fedcomp.simulation import InProcessGrid

    def run(rc):
        main(InProcessGrid(client_app, 2, rc), Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                                                       run_config=rc))

    def counters():
        with np.load(tmp_path / checkpoint.WEIGHTS) as z:
            out = {k: z[k] for k in z.files if k.startswith("w/") and k.endswith("num_batches_tracked")}
        assert out and all(v.shape == () and v.dtype == np.int64 for v in out.values())
        return out

    base = {"model": "resnet", "compressor": "topk", "density": 0.1, "seed": 3, "batch-size": 64,
            "results-dir": str(tmp_path), "client-state-dir": str(tmp_path / "s")}
    run({**base, "num-server-rounds": 1})
    first = counters()
    run({**base, "num-server-rounds": 2, "resume": True})
    assert [r["round"] for r in json.loads((tmp_path / "metrics.json").read_text())["rounds"]] == [0, 1, 2]
    second = counters()
    assert all(int(second[k]) > int(first[k]) > 0 for k in first)  # counted on from the checkpoint's value


@pytest.mark.parametrize("value", [math.inf, math.nan, 0.0])
def test_a_node_config_link_speed_must_be_finite(value):
    # Item 10, per node: uplink-mbps = inf made the simulated upload time 0 instead of an error.
    import numpy as np

    from fedcomp.client import compression_mod

    from tests.messages import make_ctx, reply_with, train_msg

    g = {"w": np.zeros(10, np.float32)}
    with pytest.raises(ValueError, match="node config 'uplink-mbps' must be a finite number > 0"):
        compression_mod(train_msg(g, {"compressor": "none"}), make_ctx(node_config={"uplink-mbps": value}),
                        lambda m, c: reply_with(m, g))
