"""Checkpoint and resume: a server stopped after round 2 and resumed produces the same later rounds
as an uninterrupted run (with client residuals persisted to a state dir)."""

import json

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from fedcomp.app.client_app import app as client_app
from fedcomp.app import checkpoint
from fedcomp.app.server_app import main
from fedcomp.run.inprocess_grid import InProcessGrid


def run(rc, nodes=3):
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=rc)
    main(InProcessGrid(client_app, nodes, rc), ctx)  # a fresh grid: fresh SuperNodes, empty context.state


@pytest.mark.parametrize("strategy", ["fedavg", "fedadam", "fedavgm"])
def test_resumed_run_equals_uninterrupted_run(tmp_path, strategy):
    # downstream "none": the broadcast's state (which copy each client holds) is not in the checkpoint, so
    # a resumed run with a compressed download gives every client the int8 start again and trains from
    # there: equal to the uninterrupted run only with a dense download
    base = {"compressor": "stc", "density": 0.05, "seed": 5, "strategy": strategy, "server-lr": 0.01,
            "downstream": "none"}
    full, part = tmp_path / "full", tmp_path / "part"
    run({**base, "num-server-rounds": 4, "results-dir": str(full), "client-state-dir": str(tmp_path / "s1")})
    run({**base, "num-server-rounds": 2, "results-dir": str(part), "client-state-dir": str(tmp_path / "s2")})
    assert json.loads((part / "checkpoint.json").read_text())["round"] == 2
    run({**base, "num-server-rounds": 4, "results-dir": str(part), "client-state-dir": str(tmp_path / "s2"),
         "resume": True})
    a = json.loads((full / "metrics.json").read_text())["rounds"]
    b = json.loads((part / "metrics.json").read_text())["rounds"]
    assert [r["round"] for r in b] == [0, 1, 2, 3, 4]
    assert [r["accuracy"] for r in a] == pytest.approx([r["accuracy"] for r in b], abs=1e-6)
    assert [r.get("upload-bytes") for r in a] == [r.get("upload-bytes") for r in b]
    with np.load(full / "checkpoint.npz") as za, np.load(part / "checkpoint.npz") as zb:
        for k in za.files:
            np.testing.assert_array_equal(za[k], zb[k])  # replies are aggregated in node-id order: bit-exact
    if strategy == "fedadam":
        with np.load(part / "checkpoint.npz") as z:
            assert any(k.startswith("v_t/") for k in z.files)


def test_resume_without_a_results_dir_or_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="'resume' = true needs 'results-dir'"):
        run({"num-server-rounds": 1, "resume": True})
    with pytest.raises(ValueError, match="checkpoint"):  # RunConfigError: one line, no traceback
        run({"num-server-rounds": 1, "resume": True, "results-dir": str(tmp_path / "empty")})


def test_checkpoint_files_are_written_atomically_and_without_pickle(tmp_path):
    run({"num-server-rounds": 1, "results-dir": str(tmp_path), "compressor": "sign"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.json", "checkpoint.npz", "flower.log",
                                                          "metrics.json", "plot.png"]
    with np.load(tmp_path / "checkpoint.npz", allow_pickle=False) as z:
        assert all(z[k].dtype != object for k in z.files)
    assert checkpoint.META == "checkpoint.json"


def test_bad_checkpoints_are_refused_with_the_file_named(tmp_path):
    run({"num-server-rounds": 1, "results-dir": str(tmp_path), "compressor": "sign"})
    meta = json.loads((tmp_path / "checkpoint.json").read_text())
    (tmp_path / "checkpoint.json").write_text("{")
    with pytest.raises(ValueError, match="unreadable"):
        run({"num-server-rounds": 2, "results-dir": str(tmp_path), "resume": True})
    (tmp_path / "checkpoint.json").write_text(json.dumps({**meta, "round": 1.7}))
    with pytest.raises(ValueError, match="integer 'round'"):
        run({"num-server-rounds": 2, "results-dir": str(tmp_path), "resume": True})
    (tmp_path / "checkpoint.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="does not fit the model"):
        run({"num-server-rounds": 2, "results-dir": str(tmp_path), "resume": True, "model": "mlp"})
    with np.load(tmp_path / "checkpoint.npz") as z:
        arrays = {k: z[k].copy() for k in z.files}
    first = next(iter(arrays))
    arrays[first].flat[0] = np.nan
    np.savez(tmp_path / "checkpoint.npz", **arrays)
    (tmp_path / "checkpoint.json").write_text(json.dumps({**meta, checkpoint.CHECKSUM: checkpoint._sha256(
        tmp_path / "checkpoint.npz")}))  # a consistent pair whose weights are not finite
    with pytest.raises(ValueError, match="not finite"):
        run({"num-server-rounds": 2, "results-dir": str(tmp_path), "resume": True})


def test_corrupt_client_residual_file_is_ignored_not_fatal(tmp_path):
    from fedcomp.client.state import load_residuals

    bad = tmp_path / "residual-0.npz"
    bad.write_bytes(b"not a zip")
    assert load_residuals(bad, before_round=3) == {}
    np.savez(bad, __round__=np.array(1), **{"r/x": np.array([np.nan], np.float32)})
    assert load_residuals(bad, before_round=3) == {}


def test_resume_keeps_privacy_accounting_honest(tmp_path):
    d = tmp_path / "cl"
    run({"num-server-rounds": 1, "results-dir": str(d), "dp": "client-level", "compressor": "sign"})
    with pytest.raises(ValueError, match="privacy settings differ"):
        run({"num-server-rounds": 2, "results-dir": str(d), "dp": "client-level", "noise-multiplier": 5.0,
             "resume": True, "compressor": "sign"})
    meta = json.loads((d / "checkpoint.json").read_text())
    (d / "checkpoint.json").write_text(json.dumps({**meta, "client-dp-rounds": -50}))
    with pytest.raises(ValueError, match="client-dp-rounds"):
        run({"num-server-rounds": 2, "results-dir": str(d), "dp": "client-level", "resume": True,
             "compressor": "sign"})
    with pytest.raises(ValueError, match="needs 'client-state-dir'"):
        run({"num-server-rounds": 2, "results-dir": str(d), "dp": "dp-sgd", "resume": True})


def test_dp_sgd_accountants_survive_a_resume_through_the_state_dir(tmp_path):
    base = {"dp": "dp-sgd", "compressor": "sign", "client-state-dir": str(tmp_path / "s")}
    run({**base, "num-server-rounds": 2, "results-dir": str(tmp_path / "r")}, nodes=2)
    run({**base, "num-server-rounds": 3, "results-dir": str(tmp_path / "r"), "resume": True}, nodes=2)
    eps = [r["epsilon-max"] for r in json.loads((tmp_path / "r" / "metrics.json").read_text())["rounds"][1:]]
    assert eps[0] < eps[1] < eps[2]  # round 3 continues from round 2's accountant, not from zero
    assert sorted(p.name for p in (tmp_path / "s").iterdir())[:2] == ["accountant-0.json", "accountant-1.json"]
