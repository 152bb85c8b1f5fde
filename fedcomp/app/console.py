"""What a run prints: one line per round on the console, everything Flower logs in a file.

Flower's strategies log several INFO lines per round (one of them the whole ``Aggregated
MetricRecord`` dict) and a closing "Final results" dump of every metric of every round. With run
config ``verbose = false`` (the default) `route_flower_logs` keeps Flower's INFO records off
the console, where fedcomp's own table remains (records whose message starts with ``fedcomp``) with
every WARNING and ERROR; all records, Flower's included, still go to ``flower.log`` in the results
folder, and every number is in ``metrics.json``.

`quiet_known_noise` (first thing the ServerApp does, verbose or not) keeps two messages a
fedcomp user cannot act on off the console, each matched by the start of its own text: Flower's
``fraction_evaluate is set to 0.0. Federated evaluation will be skipped.`` (fedcomp turns federated
evaluation off itself under ``dp``; the line still goes to ``flower.log``) and Ray's start-up
``FutureWarning`` "Tip: In future versions of Ray, ..." about accelerator environment variables.
"""

from __future__ import annotations

import logging
import pathlib
import re
import warnings

from flwr.common.logger import FLOWER_LOGGER, console_handler

#: Prefix of every line fedcomp itself logs (the table, the final lines, its warnings).
PREFIX = "fedcomp"
#: File in the results folder that receives every record of Flower's logger.
LOG_FILE = "flower.log"
#: Start of each Flower log message `WithoutKnownNoise` keeps off the console
#: (flwr/serverapp/strategy/fedavg.py, ``FedAvg.__init__`` with ``fraction_evaluate == 0.0``).
FLOWER_NOISE = ("fraction_evaluate is set to 0.0. Federated evaluation will be skipped.",)
#: Start of Ray's ``FutureWarning`` at the end of ``ray.init`` (ray/_private/worker.py) that
#: `quiet_known_noise` ignores.
RAY_TIP = "Tip: In future versions of Ray, Ray will no longer override accelerator visible devices"


class OwnLinesOnly(logging.Filter):
    """Console filter: fedcomp's records and anything at WARNING or above pass; Flower's INFO lines do not."""

    def filter(self, record: logging.LogRecord) -> bool:
        """True when the record should reach the console."""
        return record.levelno >= logging.WARNING or str(record.msg).startswith(PREFIX)


class WithoutKnownNoise(logging.Filter):
    """Console filter: drops the Flower records whose message starts with one of `FLOWER_NOISE`."""

    def filter(self, record: logging.LogRecord) -> bool:
        """False for a record in `FLOWER_NOISE`."""
        return not str(record.msg).startswith(FLOWER_NOISE)


def quiet_known_noise() -> None:
    """Keep `FLOWER_NOISE` off Flower's console handler (``flower.log`` still receives it) and
    ignore Ray's `RAY_TIP` ``FutureWarning``; every other record and warning passes.

    Called first thing in the ServerApp (before the run config is read, so a run that stops on a bad
    value is as quiet, and before Ray, started beside the ServerApp, ends its ``ray.init``). Idempotent.
    """
    if not any(isinstance(f, WithoutKnownNoise) for f in console_handler.filters):
        console_handler.addFilter(WithoutKnownNoise())
    warnings.filterwarnings("ignore", message=re.escape(RAY_TIP), category=FutureWarning)


class _RunLogFile(logging.FileHandler):
    """The per-run ``flower.log`` handler (a type of its own, so a later run replaces it)."""


def route_flower_logs(out_dir: pathlib.Path, verbose: bool) -> pathlib.Path:
    """Send every record of Flower's logger to ``out_dir / flower.log`` and, unless ``verbose``,
    keep Flower's own INFO lines off the console.

    Called once per run at ServerApp start-up; a second call (the next run in the same process)
    replaces the first one's file and filter.

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
    return path
