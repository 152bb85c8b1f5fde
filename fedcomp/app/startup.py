"""ServerApp start-up checks: run-config errors as one log line, a writable results folder, no more
SuperNodes than the data has partitions to fill."""

from __future__ import annotations

import logging
import os
import pathlib
import tempfile
import traceback

from fedcomp.app.results import resolve_results_dir
from fedcomp.task.data import DataConfig, partition_capacity, too_many_partitions


class RunConfigError(ValueError):
    """A run-config value (or the results folder it names) the ServerApp refuses at start-up.

    Flower logs a failed ServerApp with a long traceback; for this error
    `OneLineRunConfigError` prints one line naming the key instead (traceback at DEBUG).
    """


class OneLineRunConfigError(logging.Filter):
    """Filter on Flower's logger: a record carrying a `RunConfigError` becomes one ERROR
    line with the message; the traceback is logged at DEBUG. The next record that starts with
    ``Exit Code: `` (Flower's closing block for any exception of the app: ``Exit Code: 700`` /
    ``An unhandled exception occurred when running the simulation.`` / a link; 201 for a
    deployed ServerApp, from ``flwr_exit``) is dropped: the one line already said the run stopped,
    unless a record carrying another exception came between them (that exit block is its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.reported = False  # a RunConfigError was logged and Flower's exit block has not come yet

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite a RunConfigError record in place and keep it; False for the exit block after it."""
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, RunConfigError):
            trace = "".join(traceback.format_exception(*record.exc_info))
            record.msg, record.args = "fedcomp  %s (the run stopped; `flwr run` still exits 0)", (exc,)
            record.exc_info, record.exc_text = None, None
            logging.getLogger(record.name).debug("fedcomp  traceback of the run-config error:\n%s", trace)
            self.reported = True
        elif exc is not None:  # another exception: the exit block that follows is its own
            self.reported = False
        elif self.reported and str(record.msg).startswith("Exit Code: "):
            self.reported = False
            return False
        return True


def one_line_config_errors() -> None:
    """Install `OneLineRunConfigError` on Flower's logger (once per process)."""
    flwr_logger = logging.getLogger("flwr")
    if not any(isinstance(f, OneLineRunConfigError) for f in flwr_logger.filters):
        flwr_logger.addFilter(OneLineRunConfigError())


def writable_results_dir(results_dir: str, compressor: str) -> pathlib.Path:
    """`resolve_results_dir`, then a probe write: the folder must be writable now, not at
    the end of round 0.

    Raises
    ------
    RunConfigError
        The folder cannot be created or written (message: path, uid, owner uid, remedy).
    """
    out_dir = None
    try:
        out_dir = resolve_results_dir(results_dir, compressor)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as err:
        path = out_dir or pathlib.Path(err.filename or results_dir)
        owner = f"owner uid {path.stat().st_uid}" if path.exists() else "missing"
        raise RunConfigError(
            f"run config 'results-dir': the results folder {path} is not writable by uid {os.getuid()} "
            f"({owner}): {err.strerror}. Give that uid write access (Docker: see "
            "docs/how-to/docker-compose.md) or choose another results-dir") from err
    return out_dir


def check_supernodes_fit_the_data(num_nodes: int, cfg: DataConfig) -> None:
    """Refuse a federation of ``num_nodes`` SuperNodes (one partition each: Flower's simulation gives
    node ``i`` of ``N`` partition ``i`` of ``N``) that leaves partitions empty, before any round:
    their clients would fail every round they are sampled (`fedcomp.task.data.too_many_partitions`;
    datasets whose size is not known up front are not checked).

    Raises
    ------
    RunConfigError
        Naming the SuperNodes, the training examples, the most SuperNodes that fit and what to do.
    """
    why = too_many_partitions(cfg, num_nodes)
    if why:
        examples, most = partition_capacity(cfg)
        raise RunConfigError(
            f"{num_nodes} SuperNodes for {examples} training examples: {why}, so most sampled clients would "
            f"fail. Run at most {most} SuperNodes (fedcomp-simulation --supernodes {most}, or `flwr run` with "
            f"--federation-config \"num-supernodes={most}\"), or a larger dataset")
