"""What a run prints: one line per round on the console, Flower's own lines in
``flower.log``; a resumed run prints the table header; refusing a resume is one line."""

import io
import logging
import pathlib
import warnings

import pytest
from flwr.app import Context, RecordDict
from flwr.common.logger import FLOWER_LOGGER, console_handler, log

from fedcomp.app.client_app import app as client_app
from fedcomp.app.server_app import main
from fedcomp.app.console import LOG_FILE, RAY_TIP, quiet_known_noise, route_flower_logs
from fedcomp.app.startup import OneLineRunConfigError, RunConfigError
from fedcomp.run.inprocess_grid import InProcessGrid


@pytest.fixture
def console():
    """Flower's console handler writing into a buffer (restored afterwards, filters included); the
    ``flwr`` logger at DEBUG as Flower sets it (other test modules lower it to WARNING at import)."""
    buf, old_stream, old_filters = io.StringIO(), console_handler.stream, list(console_handler.filters)
    old_level = FLOWER_LOGGER.level
    console_handler.stream = buf
    FLOWER_LOGGER.setLevel(logging.DEBUG)
    yield buf
    console_handler.stream = old_stream
    console_handler.filters[:] = old_filters
    FLOWER_LOGGER.setLevel(old_level)


@pytest.mark.parametrize("verbose", [False, True])
def test_flower_lines_go_to_the_log_file_and_only_ours_to_the_console(tmp_path, console, verbose):
    path = route_flower_logs(tmp_path, verbose)
    log(logging.INFO, "[ROUND 1/2]")
    log(logging.INFO, "\t└──> Aggregated MetricRecord: {'train-loss': 2.1}")
    log(logging.INFO, "fedcomp      1   0.2000  2.2912     0.0015     0.001    312.7")
    log(logging.WARNING, "something a user can act on")
    shown = console.getvalue()
    assert "fedcomp      1" in shown and "something a user can act on" in shown
    assert ("[ROUND 1/2]" in shown) is verbose and ("Aggregated MetricRecord" in shown) is verbose
    written = path.read_text()
    assert path == tmp_path / LOG_FILE
    assert all(s in written for s in ("[ROUND 1/2]", "Aggregated MetricRecord", "fedcomp      1", "act on"))
    # a second run in the same process replaces the first one's file and filter
    (tmp_path / "next").mkdir()
    route_flower_logs(tmp_path / "next", verbose)
    log(logging.INFO, "[ROUND 2/2]")
    assert "[ROUND 2/2]" not in path.read_text()
    assert sum(type(f).__name__ == "OwnLinesOnly" for f in console_handler.filters) == (0 if verbose else 1)


def _run(rc):
    main(InProcessGrid(client_app, 2, rc), Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                                                   run_config=rc))


def test_a_resumed_run_prints_the_header_and_a_codec_change_is_refused_in_one_line(tmp_path, console, caplog):
    base = {"results-dir": str(tmp_path), "compressor": "sign", "num-server-rounds": 1, "batch-size": 64}
    _run(base)
    assert console.getvalue().count("fedcomp  round accuracy") == 1
    console.truncate(0)
    _run({**base, "num-server-rounds": 2, "resume": True})
    shown = console.getvalue()
    # the header, then round 2 only, one line each; none of Flower's INFO lines
    rows = [ln for ln in shown.splitlines() if "fedcomp" in ln]
    assert "round accuracy" in rows[1] and "resuming" in rows[0], shown
    assert [ln.split()[-8] for ln in rows[2:3]] == ["2"], shown  # 8 columns: round ... ratio up, both
    assert "[ROUND" not in shown and "Final results" not in shown
    with pytest.raises(RunConfigError) as err:
        _run({**base, "num-server-rounds": 3, "resume": True, "compressor": "stc"})
    with caplog.at_level(logging.ERROR, logger="flwr"):
        rec = logging.LogRecord("flwr", logging.ERROR, __file__, 1, "ServerApp failed", None,
                                (RunConfigError, err.value, err.value.__traceback__))
        OneLineRunConfigError().filter(rec)
    line = rec.getMessage()
    assert "\n" not in line and rec.exc_info is None
    assert "'compressor' = 'stc' (checkpoint: 'sign')" in line and "start a new run" in line


def test_flowers_fraction_evaluate_warning_stays_off_the_console_and_in_the_log_file(tmp_path, console):
    from flwr.serverapp.strategy import FedAvg

    path = route_flower_logs(tmp_path, verbose=True)
    quiet_known_noise()
    quiet_known_noise()  # idempotent: one filter
    FedAvg(fraction_evaluate=0.0)  # what build_inner makes under dp: Flower warns in __init__
    log(logging.WARNING, "fraction_evaluate is set to 0.5 and something a user can act on")
    assert console.getvalue().splitlines()[-1].endswith(
        "fraction_evaluate is set to 0.5 and something a user can act on")
    assert "Federated evaluation will be skipped" not in console.getvalue()
    assert "fraction_evaluate is set to 0.0. Federated evaluation will be skipped." in path.read_text()
    assert sum(type(f).__name__ == "WithoutKnownNoise" for f in console_handler.filters) == 1


def test_rays_accelerator_tip_is_ignored_and_other_warnings_pass():
    ray_worker = pytest.importorskip("ray._private.worker")
    tip = (f"{RAY_TIP} env var if num_gpus=0 or num_gpus=None (default). To enable this behavior and turn off "
           "this error message, set RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0")
    # the text as the installed Ray writes it (its literal continues on the next source lines)
    assert f'"{tip}"' in pathlib.Path(ray_worker.__file__).read_text().replace('"\n            "', "")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_known_noise()
        warnings.warn(tip, FutureWarning, stacklevel=1)
        warnings.warn("Tip: In future versions of numpy, something else", FutureWarning, stacklevel=1)
        warnings.warn(tip, DeprecationWarning, stacklevel=1)
    assert [(w.category, str(w.message)) for w in caught] == [
        (FutureWarning, "Tip: In future versions of numpy, something else"), (DeprecationWarning, tip)]


def test_a_run_that_ends_near_chance_says_so_in_its_last_line(tmp_path, console):
    """A run that does not learn says so in its last line, and a run that learns does not get the line."""
    _run({"results-dir": str(tmp_path / "flat"), "compressor": "sign", "num-server-rounds": 1, "batch-size": 64,
          "lr": 1e-9, "fraction-evaluate": 0.0})
    last = [ln for ln in console.getvalue().splitlines() if "fedcomp" in ln][-1]
    assert "the run ended near chance" in last and "most frequent label" in last, last
    console.truncate(0)
    console.seek(0)
    _run({"results-dir": str(tmp_path / "learns"), "compressor": "none", "num-server-rounds": 3, "lr": 0.1,
          "fraction-evaluate": 0.0})
    assert "near chance" not in console.getvalue()
