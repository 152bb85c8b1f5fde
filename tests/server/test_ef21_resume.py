"""EF21 across a resume: the server's estimate h is in the checkpoint, the clients' h_i in the
client state dir, and a resumed run equals an uninterrupted one, also when the server stopped
after the clients had saved a round it never checkpointed."""

import logging
import json
import shutil

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from fedcomp.app.client_app import app as client_app
from fedcomp.client.state import load_residuals, previous_path, save_residuals
from fedcomp.app.server_app import main
from fedcomp.run.inprocess_grid import InProcessGrid
from fedcomp.strategies.ef21_aggregate import EF21Aggregate

BASE = {"compressor": "stc", "density": 0.05, "seed": 7, "error-feedback": "ef21", "model": "mlp",
        "fraction-evaluate": 0.0,
        "downstream": "none"}  # the download's state is not checkpointed: resumes are exact only with a dense one


def run(rc, nodes=2):
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=rc)
    main(InProcessGrid(client_app, nodes, rc), ctx)  # a fresh grid: fresh SuperNodes, empty context.state


def rounds_of(folder):
    return json.loads((folder / "metrics.json").read_text())["rounds"]


def assert_same_run(full, part):
    a, b = rounds_of(full), rounds_of(part)
    assert [r["round"] for r in b] == [0, 1, 2, 3, 4]
    assert [r["accuracy"] for r in a] == pytest.approx([r["accuracy"] for r in b], abs=1e-6)
    assert [r.get("upload-bytes") for r in a] == [r.get("upload-bytes") for r in b]
    with np.load(full / "checkpoint.npz") as za, np.load(part / "checkpoint.npz") as zb:
        assert sorted(za.files) == sorted(zb.files)
        assert any(k.startswith("ef21/") for k in za.files)
        for k in za.files:
            np.testing.assert_array_equal(za[k], zb[k])  # weights and h, bit for bit


@pytest.mark.slow
def test_ef21_resume_after_the_clients_saved_a_round_the_server_did_not_checkpoint(tmp_path):
    """Resumed twice: from round 2 to 3, then (the server stopped in round 3 after the clients
    saved their h_i of round 3) from round 2 again: the resumed round 3 starts from the clients'
    round-2 files (the ``.prev.npz``), which match the round-2 checkpoint's h. Same as uninterrupted."""
    full, part, saved = tmp_path / "full", tmp_path / "part", tmp_path / "round2"
    run({**BASE, "num-server-rounds": 4, "results-dir": str(full), "client-state-dir": str(tmp_path / "s1")})
    run({**BASE, "num-server-rounds": 2, "results-dir": str(part), "client-state-dir": str(tmp_path / "s2")})
    with np.load(part / "checkpoint.npz") as z:
        h = {k: z[k] for k in z.files if k.startswith("ef21/")}
    assert h and all(v.dtype == np.float64 and v.ndim == 1 for v in h.values()) and any(v.any() for v in h.values())
    shutil.copytree(part, saved)
    run({**BASE, "num-server-rounds": 3, "results-dir": str(part), "client-state-dir": str(tmp_path / "s2"),
         "resume": True})  # the clients' files are now from round 3 ...
    shutil.rmtree(part)
    shutil.copytree(saved, part)  # ... and the server's checkpoint is back at round 2
    assert sorted(p.name for p in (tmp_path / "s2").glob("residual-*.prev.npz"))
    run({**BASE, "num-server-rounds": 4, "results-dir": str(part), "client-state-dir": str(tmp_path / "s2"),
         "resume": True})
    assert_same_run(full, part)


def test_ef21_resume_needs_the_client_state_dir(tmp_path):
    run({**BASE, "num-server-rounds": 1, "results-dir": str(tmp_path)})
    with pytest.raises(ValueError, match="'ef21' needs 'client-state-dir'"):
        run({**BASE, "num-server-rounds": 2, "results-dir": str(tmp_path), "resume": True})


def test_a_checkpoint_with_h_does_not_resume_without_ef21(tmp_path):
    run({**BASE, "num-server-rounds": 1, "results-dir": str(tmp_path), "client-state-dir": str(tmp_path / "s")})
    with pytest.raises(ValueError, match="EF21's server estimate h but error-feedback is not 'ef21'"):
        run({**BASE, "error-feedback": True, "num-server-rounds": 2, "results-dir": str(tmp_path), "resume": True})


def test_server_estimate_is_checked_on_load():
    agg = EF21Aggregate()
    shapes = {"w": (2, 3), "b": (3,)}
    agg.load_state_dict({"w": np.arange(6, dtype=np.float64)}, shapes)
    np.testing.assert_array_equal(agg.state_dict()["w"], np.arange(6.0))
    for bad in ({"w": np.zeros(5)}, {"w": np.zeros((2, 3))}, {"w": np.zeros(6, dtype=np.float32)},
                {"w": np.full(6, np.inf)}, {"x": np.zeros(6)}):
        with pytest.raises(ValueError, match="EF21's server estimate"):
            agg.load_state_dict(bad, shapes)
        np.testing.assert_array_equal(agg.h["w"], np.arange(6.0))  # unchanged


def test_residual_files_keep_the_previous_round(tmp_path):
    path = tmp_path / "residual-0.npz"
    save_residuals(path, {"a": np.full(2, 1.0, np.float32)}, 1)
    save_residuals(path, {"a": np.full(2, 2.0, np.float32)}, 2)
    assert previous_path(path).name == "residual-0.prev.npz"
    assert load_residuals(path, before_round=3)["a"].tolist() == [2.0, 2.0]
    assert load_residuals(path, before_round=2)["a"].tolist() == [1.0, 1.0]  # resumed from round 1's checkpoint
    assert load_residuals(path, before_round=1) == {}  # nothing before round 1
    save_residuals(path, {"a": np.full(2, 3.0, np.float32)}, 2)  # round 2 again: round 1's file stays
    assert load_residuals(path, before_round=2)["a"].tolist() == [1.0, 1.0]
    assert load_residuals(path, before_round=3)["a"].tolist() == [3.0, 3.0]


def test_a_resume_more_than_one_round_back_is_said_not_silent(tmp_path, caplog):
    path = tmp_path / "residual-1.npz"
    for r in (1, 2, 3, 4):
        save_residuals(path, {"a": np.full(2, float(r), np.float32)}, r)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert load_residuals(path, before_round=3) == {}  # files hold rounds 4 and 3: none before round 3
    (line,) = [r.getMessage() for r in caplog.records if "zero residual" in r.getMessage()]
    assert line.startswith("fedcomp: round 3: residual-1.npz is from round 4 and no saved residual is from "
                           "before round 3 (the server started again or resumed from a checkpoint more than one "
                           "round back)")


def test_a_tampered_record_of_folded_sends_is_refused(tmp_path):
    """Attack finding: a checkpoint whose EF21 record names a node twice (the last round silently won) or a
    round after the checkpoint's own (that node refused as EF21_STATE_MISMATCH for the rest of the run)
    loaded without a word; now each is the checkpoint's ValueError."""
    from flwr.serverapp.strategy import FedAvg

    from fedcomp.app import checkpoint
    from fedcomp.strategies import CompressedStrategy

    def strategy():
        return CompressedStrategy(FedAvg(fraction_evaluate=0.0), compressor="stc", error_feedback="ef21")

    s = strategy()
    s.ef21.h, s.ef21.folded = {"w": np.zeros(4)}, {5: 2, 6: 2}
    checkpoint.save(tmp_path, 2, {"w": np.zeros(4, np.float32)}, s, [{"round": 2}])
    back = strategy()
    assert checkpoint.load(tmp_path, back)[0] == 2 and back.ef21.folded == {5: 2, 6: 2}
    s.ef21.folded = {5: 3, 6: 2}
    checkpoint.save(tmp_path, 2, {"w": np.zeros(4, np.float32)}, s, [{"round": 2}])
    with pytest.raises(ValueError) as err:
        checkpoint.load(tmp_path, strategy())
    assert str(err.value) == (f"checkpoint in {tmp_path}: EF21's record of folded sends names round 3, after the "
                              "checkpoint's round 2")
    twice = {"nodes": np.array([5, 5], np.uint64), "rounds": np.array([1, 2], np.int64)}
    with pytest.raises(ValueError) as err:
        EF21Aggregate().load_state_dict({"w": np.zeros(4)}, {"w": (4,)}, twice)
    assert str(err.value) == ("EF21's record of folded sends is not node ids (uint64, each once) and rounds "
                              "(int64 >= 0) of one length")
