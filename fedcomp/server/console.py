"""What a run prints: one line per round on the console, everything Flower logs in a file.

Flower's strategies log ~7 INFO lines per round (one a ~740-character ``Aggregated MetricRecord``
dict) and a closing "Final results" dump of every metric of every round (1170 lines for the
default 50-round run). With run config ``verbose = false`` (the default) :func:`route_flower_logs`
keeps Flower's INFO records off the console, where fedcomp's own table remains (records whose
message starts with ``fedcomp``) with every WARNING and ERROR; all records, Flower's included,
still go to ``flower.log`` in the results folder, and every number is in ``metrics.json``.
"""

from __future__ import annotations

import logging
import pathlib
import warnings

from flwr.common.logger import FLOWER_LOGGER, console_handler

#: Prefix of every line fedcomp itself logs (the table, the final lines, its warnings).
PREFIX = "fedcomp"
#: File in the results folder that receives every record of Flower's logger.
LOG_FILE = "flower.log"


class OwnLinesOnly(logging.Filter):
    """Console filter: fedcomp's records and anything at WARNING or above pass; Flower's INFO lines do not."""

    def filter(self, record: logging.LogRecord) -> bool:
        """True when the record should reach the console."""
        return record.levelno >= logging.WARNING or str(record.msg).startswith(PREFIX)


class _RunLogFile(logging.FileHandler):
    """The per-run ``flower.log`` handler (a type of its own, so a later run replaces it)."""


def route_flower_logs(out_dir: pathlib.Path, verbose: bool) -> pathlib.Path:
    """Send every record of Flower's logger to ``out_dir / flower.log`` and, unless ``verbose``,
    keep Flower's own INFO lines off the console.

    Called once per run at ServerApp start-up; a second call (the next run in the same process)
    replaces the first one's file and filter. Also hides Ray's start-up ``FutureWarning`` about
    accelerator environment variables (a tip about a future Ray default that a user of the
    simulation cannot act on), when Ray is started after this call.

    Parameters
    ----------
    out_dir : pathlib.Path
        The run's results folder (exists and is writable).
    verbose : bool
        Run config ``verbose``: True keeps Flower's console output as Flower prints it.

    Returns
    -------
    pathlib.Path
        The log file.
    """
    for handler in [h for h in FLOWER_LOGGER.handlers if isinstance(h, _RunLogFile)]:
        FLOWER_LOGGER.removeHandler(handler)
        handler.close()
    for filt in [f for f in console_handler.filters if isinstance(f, OwnLinesOnly)]:
        console_handler.removeFilter(filt)
    path = out_dir / LOG_FILE
    handler = _RunLogFile(path, encoding="utf-8")
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s"))
    FLOWER_LOGGER.addHandler(handler)
    if not verbose:
        console_handler.addFilter(OwnLinesOnly())
    warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)
    return path
