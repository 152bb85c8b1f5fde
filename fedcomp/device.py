"""What a client reports about the device it runs on: its machine (``platform.machine()``, e.g.
``"aarch64"`` on a Raspberry Pi 4/5 or a Jetson, ``"x86_64"``), Python and torch versions, and the
peak resident memory of its process.

The ClientApp puts :func:`client_info` into every train reply as a ConfigRecord under
:data:`CLIENT_INFO_KEY` (strings travel in ConfigRecords, not MetricRecords); ``compression_mod`` adds
``client-peak-rss-mb`` (:func:`peak_rss_mb`, measured after compressing) to the reply's metrics.
The server counts the machines per round (``client-machines`` in metrics.json) and reports the largest
peak RSS (``client-peak-rss-mb``). Both are the client's own, unverified statements.
"""

from __future__ import annotations

import platform
import re

from flwr.app import ConfigRecord

#: Train-reply ConfigRecord holding :func:`client_info`.
CLIENT_INFO_KEY = "fedcomp.client-info"
#: Longest machine name the server keeps from a reply (untrusted input).
MAX_MACHINE_CHARS = 32


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (Linux ``VmHWM``; elsewhere
    ``getrusage``'s ``ru_maxrss``, bytes on macOS, KiB on Linux/BSD). 0.0 where neither exists.

    In Flower's simulation many ClientApps share one worker process: the figure is that process's.
    """
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    try:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 1024
    except (ImportError, OSError):
        return 0.0


def client_info() -> ConfigRecord:
    """``machine`` (``platform.machine()``), ``system``, ``python`` and ``torch`` versions, as strings."""
    import torch

    return ConfigRecord({"machine": platform.machine(), "system": platform.system(),
                         "python": platform.python_version(), "torch": torch.__version__})


def reported_machine(content) -> str | None:
    """The ``machine`` a train reply claims (server side; untrusted): a short ``[A-Za-z0-9_.-]`` name,
    or None when the reply carries none or something else."""
    rec = content.config_records.get(CLIENT_INFO_KEY) if hasattr(content, "config_records") else None
    v = rec.get("machine") if rec is not None else None
    if not isinstance(v, str) or not re.fullmatch(rf"[A-Za-z0-9_.-]{{1,{MAX_MACHINE_CHARS}}}", v):
        return None
    return v
