"""Checkpoints: one atomic unit (a torn or edited pair is refused), every array keeps its shape and dtype
(0-d integer buffers included), and a resume with another codec is refused naming the setting."""

import pytest


def _zoo():
    import numpy as np

    return {"scale": np.array(0.5, np.float32), "num_batches_tracked": np.array(7, np.int64),
            "lut": np.arange(6, dtype=np.uint8).reshape(2, 3), "mask": np.array([True, False, True]),
            "half": np.array([1.5, -2.0], np.float16), "empty": np.zeros((0, 5), np.float32)}


def test_checkpoint_keeps_every_shape_and_dtype(tmp_path):
    import numpy as np

    from fedcomp.app import checkpoint

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

    from fedcomp.app import checkpoint

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

    from fedcomp.app import checkpoint

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


def test_resume_with_another_codec_is_refused_naming_the_setting(tmp_path):
    import json

    from flwr.app import Context, RecordDict

    from fedcomp.app.client_app import app as client_app
    from fedcomp.app.server_app import main
    from fedcomp.run.inprocess_grid import InProcessGrid

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


def test_a_batchnorm_model_resumes_with_its_integer_buffers(tmp_path):
    # 0-d int64 num_batches_tracked through checkpoint and resume (before: saved as shape (1,) and
    # refused on resume as "does not fit the model"). Bit-exact resume is test_resume's (cnn).
    import json

    import numpy as np
    from flwr.app import Context, RecordDict

    from fedcomp.app.client_app import app as client_app
    from fedcomp.app import checkpoint
    from fedcomp.app.server_app import main
    from fedcomp.run.inprocess_grid import InProcessGrid

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


@pytest.mark.parametrize("key, value, problem", [
    ("strategy-settings", "fedavg", "'extra' 'strategy-settings' must be an object (the run's recorded settings)"),
    ("strategy-settings", None, "'extra' 'strategy-settings' must be an object (the run's recorded settings)"),
    ("codec-settings", ["stc"], "'extra' 'codec-settings' must be an object (the run's recorded settings)"),
    ("privacy-settings", 5, "'extra' 'privacy-settings' must be an object (the run's recorded settings)"),
    ("cum-mb", "12", "'extra' 'cum-mb' must be a number >= 0"),
    ("cum-down-mb", None, "'extra' 'cum-down-mb' must be a number >= 0"),
    ("last-eps", -1.0, "'extra' 'last-eps' must be a number >= 0"),
])
def test_a_hand_edited_settings_record_is_refused_naming_it(tmp_path, key, value, problem):
    """Attack finding: a manifest whose recorded strategy/codec/privacy settings are not objects (or whose
    running totals are not numbers) crashed the resume with AttributeError/TypeError ('str' object has no
    attribute 'items'); now it is the checkpoint's ValueError naming the field."""
    import json

    import numpy as np

    from fedcomp.app import checkpoint

    checkpoint.save(tmp_path, 1, {"w": np.zeros(4, np.float32)}, None, [{"round": 1}],
                    {"cum-mb": 1.0, "cum-down-mb": 2.0, "last-eps": None, "strategy-settings": {"strategy": "fedavg"},
                     "codec-settings": {"compressor": "stc"}, "privacy-settings": {"dp": "none"}})
    assert checkpoint.load(tmp_path, None)[0] == 1  # the written one loads
    meta = json.loads((tmp_path / checkpoint.META).read_text())
    meta["extra"][key] = value
    (tmp_path / checkpoint.META).write_text(json.dumps(meta))
    with pytest.raises(ValueError) as err:
        checkpoint.load(tmp_path, None)
    assert str(err.value) == f"{tmp_path / checkpoint.META}: {problem}"


def test_resume_with_other_data_settings_is_refused_naming_both_values(tmp_path, caplog):
    """A resume with another seed, partitioner or dirichlet-alpha once trained on other partitions silently."""
    import json
    from flwr.app import Context, RecordDict
    from fedcomp.app import checkpoint
    from fedcomp.app.client_app import app as client_app
    from fedcomp.app.server_app import main
    from fedcomp.run.inprocess_grid import InProcessGrid

    def run(rc):
        main(InProcessGrid(client_app, 2, rc), Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                                                       run_config=rc))
    base = {"results-dir": str(tmp_path), "client-state-dir": str(tmp_path / "s"), "compressor": "sign"}
    run({**base, "num-server-rounds": 1})
    meta = json.loads((tmp_path / checkpoint.META).read_text())
    assert meta["extra"]["data-settings"] == {"seed": 42, "dataset": "digits", "partitioner": "dirichlet",
                                              "dirichlet-alpha": 0.5}
    before = (tmp_path / "metrics.json").read_text()
    resume = {**base, "num-server-rounds": 2, "resume": True}
    with pytest.raises(ValueError, match=r"^run config 'resume': the data settings differ from the checkpoint's: "
                                         r"'seed' = 7 \(checkpoint: 42\)\. "):
        run({**resume, "seed": 7})
    with pytest.raises(ValueError, match=r"'partitioner' = 'iid' \(checkpoint: 'dirichlet'\), "
                                         r"'dirichlet-alpha' = 0\.1 \(checkpoint: 0\.5\)"):
        run({**resume, "partitioner": "iid", "dirichlet-alpha": 0.1})
    assert (tmp_path / "metrics.json").read_text() == before
    # a checkpoint written before the data settings were recorded resumes, with one WARNING
    del meta["extra"]["data-settings"]
    (tmp_path / checkpoint.META).write_text(json.dumps(meta))
    caplog.clear()
    run(resume)
    said = [r.getMessage() for r in caplog.records if "records no data settings" in r.getMessage()]
    assert len(said) == 1
