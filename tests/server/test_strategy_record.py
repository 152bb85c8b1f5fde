"""Attack finding F5: the resolved server strategy is recorded in the checkpoint, and a resume whose run
config resolves to another one (e.g. "auto" choosing FedAvgM where the checkpoint's run used FedAvg) is
refused with both values, not switched silently; a checkpoint that predates the record gets one WARNING."""

import json
import logging

import pytest
from flwr.app import Context, RecordDict
from flwr.serverapp.strategy import FedAvg, FedAvgM

from fedcomp.app.client_app import app as client_app
from fedcomp.app.config import AppConfig
from fedcomp.app.server_app import main
from fedcomp.app.strategy_record import EXTRA_KEY, check_same_strategy, strategy_settings
from fedcomp.run.inprocess_grid import InProcessGrid
from fedcomp.strategies import CompressedStrategy

LOW = {"compressor": "stc", "density": 0.001, "model": "mlp", "seed": 1}


def run(rc, nodes=2):
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=rc)
    main(InProcessGrid(client_app, nodes, rc), ctx)


def test_settings_hold_what_the_strategy_uses():
    assert strategy_settings(AppConfig.from_run_config(LOW)) == {"strategy": "fedavgm", "server-lr": 1.0,
                                                                 "server-momentum": 0.5}
    assert strategy_settings(AppConfig.from_run_config({**LOW, "strategy": "fedavg"})) == {"strategy": "fedavg"}
    assert strategy_settings(AppConfig.from_run_config({"strategy": "fedadam", "server-lr": 0.01})) == {
        "strategy": "fedadam", "server-lr": 0.01}


def test_a_recorded_strategy_that_differs_is_refused_with_both_values():
    cfg = AppConfig.from_run_config(LOW)  # "auto" -> fedavgm
    meta = {"round": 3, "extra": {EXTRA_KEY: {"strategy": "fedavg"}}}
    with pytest.raises(ValueError) as err:
        check_same_strategy(meta, cfg, CompressedStrategy(FedAvgM(), compressor="stc"), "runs/a")
    assert str(err.value) == (
        "run config 'resume': the server strategy differs from the checkpoint's: strategy = 'fedavgm', "
        "server-lr = 1.0, server-momentum = 0.5 (checkpoint: strategy = 'fedavg'). The checkpoint's optimizer state "
        "and past rounds belong to its strategy: set these run-config keys to the checkpoint's values to resume, "
        "or start a new run (another 'results-dir')")
    meta["extra"][EXTRA_KEY] = {"strategy": "fedavgm", "server-lr": 1.0, "server-momentum": 0.9}
    with pytest.raises(ValueError, match=r"server-momentum = 0.5 \(checkpoint: .*server-momentum = 0.9\)"):
        check_same_strategy(meta, cfg, CompressedStrategy(FedAvgM(), compressor="stc"), "runs/a")
    meta["extra"][EXTRA_KEY] = strategy_settings(cfg)
    check_same_strategy(meta, cfg, CompressedStrategy(FedAvgM(), compressor="stc"), "runs/a")  # same: resumes


def test_an_old_checkpoint_gets_one_warning_naming_the_assumption(caplog):
    cfg = AppConfig.from_run_config({**LOW, "strategy": "fedavg"})
    with caplog.at_level(logging.WARNING, logger="flwr"):
        check_same_strategy({"round": 2, "extra": {}}, cfg, CompressedStrategy(FedAvg(), compressor="stc"), "runs/a")
    assert [r.getMessage() for r in caplog.records] == [
        "fedcomp  the checkpoint in runs/a records no server strategy (written by an earlier fedcomp): assuming it "
        "ran strategy = 'fedavg', what the run config resolves to now"]


def test_an_old_fedavg_checkpoint_is_not_resumed_as_fedavgm(tmp_path):
    """The finding end to end: a run at density 1/1000 with FedAvg (as 'auto' resolved before the
    low-density defaults), its checkpoint stripped of the record, resumed with 'auto' (now FedAvgM)."""
    d = tmp_path / "run"
    run({**LOW, "strategy": "fedavg", "num-server-rounds": 1, "results-dir": str(d)})
    meta = json.loads((d / "checkpoint.json").read_text())
    assert meta["extra"][EXTRA_KEY] == {"strategy": "fedavg"}
    del meta["extra"][EXTRA_KEY]  # as written before the record existed
    (d / "checkpoint.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError) as err:
        run({**LOW, "num-server-rounds": 2, "results-dir": str(d), "resume": True})
    assert str(err.value) == (
        f"run config 'resume': the checkpoint in {d} records no server strategy (written by an earlier fedcomp) and "
        "holds no server-optimizer state, so its run used 'fedavg'; the run config resolves to strategy = 'fedavgm', "
        "server-lr = 1.0, server-momentum = 0.5 (strategy = \"auto\" chooses server momentum at low density since "
        "then): set strategy = \"fedavg\" to resume it, or start a new run")
    run({**LOW, "strategy": "fedavg", "num-server-rounds": 2, "results-dir": str(d), "resume": True})
    assert [r["round"] for r in json.loads((d / "metrics.json").read_text())["rounds"]] == [0, 1, 2]
