"""ServerApp start-up: no Opacus unless DP-SGD runs (Opacus calls logging.basicConfig at import,
which printed every log line twice), one line for a bad run config, and an unwritable results
folder refused before round 0."""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest
from flwr.common.logger import log

from fedcomp.app.startup import OneLineRunConfigError, RunConfigError, writable_results_dir


def test_importing_the_apps_loads_no_opacus_and_no_dp_sgd_module():
    code = ("import sys, logging, fedcomp.app.server_app, fedcomp.app.client_app\n"
            "print('opacus' in sys.modules, 'fedcomp.privacy.dp_sgd' in sys.modules, len(logging.root.handlers))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "0"]


def test_a_flower_log_line_prints_once_after_the_server_app_is_imported():
    code = ("import fedcomp.app.server_app\nfrom logging import INFO, DEBUG\nfrom flwr.common.logger import log\n"
            "log(INFO, 'fedcomp      1   0.5000')\nlog(DEBUG, 'a debug line')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = (out.stdout + out.stderr).splitlines()
    assert sum("fedcomp      1   0.5000" in ln for ln in lines) == 1
    assert not any("a debug line" in ln for ln in lines)


def test_dp_sgd_keys_are_still_validated_when_dp_sgd_runs():
    from types import SimpleNamespace

    from fedcomp.app.config import AppConfig
    from fedcomp.app.server_app import concern_options

    cfg = AppConfig.from_run_config({"dp": "dp-sgd"})
    with pytest.raises(ValueError, match="'accountant'"):
        concern_options(cfg, SimpleNamespace(run_config={"dp": "dp-sgd", "accountant": "nope"}))


def test_a_run_config_error_is_logged_as_one_line(caplog):
    logger = logging.getLogger("flwr")
    filt = OneLineRunConfigError()
    logger.addFilter(filt)
    try:
        try:
            raise RunConfigError("run config 'density' must be in (0.0, 1.0], got 2.0")
        except RunConfigError as err:
            with caplog.at_level(logging.DEBUG, logger="flwr"):
                log(logging.ERROR, "%s raised an exception", "ServerApp", exc_info=err)  # as Flower does
    finally:
        logger.removeFilter(filt)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None
    assert errors[0].getMessage() == ("fedcomp  run config 'density' must be in (0.0, 1.0], got 2.0 "
                                      "(the run stopped; `flwr run` still exits 0)")
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(debug) == 1 and "Traceback" in debug[0].getMessage()


def _flower_exit_message(code: int) -> str:
    """The message ``flwr.supercore.exit.flwr_exit`` logs at ERROR for an error exit code (flwr 1.42)."""
    from flwr.supercore.exit.exit import _get_code_url
    from flwr.supercore.exit.exit_code import EXIT_CODE_HELP

    return f"Exit Code: {code}\n\n{EXIT_CODE_HELP[code]}\n\nFor more information, visit: <{_get_code_url(code)}>"


def test_flowers_exit_block_after_a_run_config_error_is_dropped_and_any_other_kept(caplog):
    logger = logging.getLogger("flwr")
    saved = list(logger.filters)  # the process-wide one a ServerApp run in another test installed: not this one
    logger.filters[:] = [OneLineRunConfigError()]
    try:
        with caplog.at_level(logging.DEBUG, logger="flwr"):
            log(logging.ERROR, _flower_exit_message(700))  # no run-config error before it: kept
            try:
                raise RunConfigError("run config 'density' must be in (0.0, 1.0], got 1.5")
            except RunConfigError as err:
                log(logging.ERROR, "%s raised an exception", "Simulation", exc_info=err)  # as Flower does
            log(logging.ERROR, _flower_exit_message(700))  # Flower's flwr_exit right after: dropped
            log(logging.ERROR, _flower_exit_message(201))  # a later one: kept
    finally:
        logger.filters[:] = saved
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [_flower_exit_message(700),
                      ("fedcomp  run config 'density' must be in (0.0, 1.0], got 1.5 (the run stopped; `flwr run` "
                       "still exits 0)"),
                      _flower_exit_message(201)]
    assert "An unhandled exception occurred when running the simulation." in errors[0]


def test_the_exit_block_of_a_later_crash_is_kept(caplog):
    """Attack finding: the filter stays installed for the process, and a run-config error whose exit block
    never came (a ServerApp run in-process) left it armed: the exit block of a later, real crash was dropped.
    A record carrying another exception disarms it."""
    logger = logging.getLogger("flwr")
    saved = list(logger.filters)
    logger.filters[:] = [OneLineRunConfigError()]
    try:
        with caplog.at_level(logging.DEBUG, logger="flwr"):
            try:
                raise RunConfigError("run config 'density' must be in (0.0, 1.0], got 1.5")
            except RunConfigError as err:
                log(logging.ERROR, "%s raised an exception", "ServerApp", exc_info=err)
            try:
                raise RuntimeError("a real crash")
            except RuntimeError as err:
                log(logging.ERROR, "%s raised an exception", "ServerApp", exc_info=err)
            log(logging.ERROR, _flower_exit_message(700))
    finally:
        logger.filters[:] = saved
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [("fedcomp  run config 'density' must be in (0.0, 1.0], got 1.5 (the run stopped; `flwr run` "
                       "still exits 0)"), "ServerApp raised an exception", _flower_exit_message(700)]


def test_other_errors_keep_their_traceback(caplog):
    with caplog.at_level(logging.DEBUG, logger="flwr"):
        try:
            raise KeyError("x")
        except KeyError as err:
            filt = OneLineRunConfigError()
            record = logging.LogRecord("flwr", logging.ERROR, __file__, 1, "boom", (), (type(err), err, None))
            assert filt.filter(record) and record.exc_info is not None and record.msg == "boom"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_results_folder_is_refused_naming_path_and_uid(tmp_path):
    locked = tmp_path / "results"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(RunConfigError, match=rf"results folder {locked} is not writable by uid {os.getuid()}"):
            writable_results_dir(str(locked), "stc")
    finally:
        locked.chmod(0o700)


def test_unwritable_results_folder_as_another_uid():
    """As root (CI), drop to uid 4242 in a child process to see the same refusal."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch uid")
    locked = pathlib.Path(tempfile.mkdtemp(prefix="fedcomp-locked-"))  # root's, mode 0755: not writable by 4242
    locked.chmod(0o755)
    code = ("import os\nfrom fedcomp.app.server_app import writable_results_dir, RunConfigError\n"
            "os.setgid(4242); os.setuid(4242)\n"
            f"try:\n    writable_results_dir({str(locked)!r}, 'stc')\n"
            "except RunConfigError as e:\n    print(e)\n")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "HOME": str(locked)})
    finally:
        shutil.rmtree(locked)
    assert f"the results folder {locked} is not writable by uid 4242 (owner uid 0)" in out.stdout, out.stderr
