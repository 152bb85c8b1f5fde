"""What a client reports about the device it runs on: its machine (``platform.machine()``, e.g.
``"aarch64"`` on a Raspberry Pi 4/5 or a Jetson, ``"x86_64"``), Python and torch versions, and the
peak resident memory of its process.

The ClientApp puts `client_info` into every train reply as a ConfigRecord under
`CLIENT_INFO_KEY` (strings travel in ConfigRecords, not MetricRecords); ``compression_mod`` adds
`memory_report` (measured after compressing) to the reply's metrics: ``client-peak-rss-mb``,
the memory limit of the client's container (``client-memory-limit-mb``, 0 without one) and how many
processes the kernel's out-of-memory killer has killed in it (``client-oom-kills``).
The server counts the machines per round (``client-machines`` in metrics.json), reports the largest
peak RSS (``client-peak-rss-mb``) and each client's (``client-peak-rss``: node id -> MiB). All are
the client's own, unverified statements: a report no device can make (`implausible_memory_report`)
is dropped and counted (``dropped-device-reports``).
"""

from __future__ import annotations

import platform
import re

from flwr.app import ConfigRecord

#: Train-reply ConfigRecord holding `client_info`.
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


#: cgroup files, v2 then v1 (inside a container the container's own; on a host the root's).
CGROUP_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
CGROUP_OOM_FILES = ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control")
#: A cgroup v1 "limit" this large (2^62 bytes and up) means none.
NO_LIMIT_BYTES = 2**62


def memory_limit_mb(files: tuple[str, ...] = CGROUP_LIMIT_FILES) -> float:
    """The memory limit of this process's cgroup in MiB (``docker run --memory 512m``: 512.0); 0.0
    when there is none (cgroup v2 ``max``, v1's huge default) or no cgroup file is readable."""
    for path in files:
        try:
            with open(path) as fh:
                text = fh.read().strip()
        except OSError:
            continue
        if not text.isdigit() or int(text) >= NO_LIMIT_BYTES:
            return 0.0
        return int(text) / 2**20
    return 0.0


def oom_kills(files: tuple[str, ...] = CGROUP_OOM_FILES) -> int:
    """How many processes the kernel's out-of-memory killer has killed in this process's cgroup
    (the ``oom_kill`` line of cgroup v2 ``memory.events`` or v1 ``memory.oom_control``; Linux >= 4.13);
    0 when no file says. In a container, the count since the container started."""
    for path in files:
        try:
            with open(path) as fh:
                for line in fh:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and value.strip().isdigit():
                        return int(value)
        except OSError:
            continue
    return 0


def memory_report() -> dict[str, float]:
    """The train reply's memory metrics: ``client-peak-rss-mb`` (`peak_rss_mb`),
    ``client-memory-limit-mb`` (`memory_limit_mb`) and ``client-oom-kills`` (`oom_kills`)."""
    return {"client-peak-rss-mb": peak_rss_mb(), "client-memory-limit-mb": memory_limit_mb(),
            "client-oom-kills": float(oom_kills())}


#: The train reply's metrics of `memory_report`.
MEMORY_REPORT_KEYS = ("client-peak-rss-mb", "client-memory-limit-mb", "client-oom-kills")
#: Largest MiB figure a device report may state (2^30 MiB, 1 PiB: no machine's memory comes near).
MAX_REPORTED_MB = float(2**30)
#: Largest out-of-memory kill count a device report may state.
MAX_REPORTED_OOM_KILLS = 2**31 - 1


def implausible_memory_report(metrics) -> str | None:
    """Why a reply's `memory_report` figures cannot be true (server side; untrusted), or None
    when each one it carries is possible; an absent figure is fine (no report).

    Possible: ``client-peak-rss-mb`` and ``client-memory-limit-mb`` finite numbers in
    [0, `MAX_REPORTED_MB`] MiB, ``client-oom-kills`` a whole number in
    [0, `MAX_REPORTED_OOM_KILLS`]. The reason names the first figure that is not, e.g.
    ``"client-peak-rss-mb = -5.0 is not in [0, 1073741824] MiB"``.
    """
    for key, top, unit in (("client-peak-rss-mb", MAX_REPORTED_MB, " MiB"),
                           ("client-memory-limit-mb", MAX_REPORTED_MB, " MiB"),
                           ("client-oom-kills", float(MAX_REPORTED_OOM_KILLS), "")):
        if key not in metrics:
            continue
        v = metrics[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return f"{key} is not a number"
        if not (0.0 <= v <= top) or (not unit and v != int(v)):
            kind = "a whole number in" if not unit else "in"
            return f"{key} = {float(v)!r} is not {kind} [0, {top:.0f}]{unit}"
    return None


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


#: ``sys.argv[0]`` of the process Flower starts for each message a SuperNode receives (its default
#: ``--isolation subprocess``): the whole life of that process belongs to one round.
CLIENTAPP_PROCESS = "flwr-clientapp"


def clientapp_seconds() -> float:
    """Seconds this ClientApp process has lived, when Flower started it for the one message it
    handles (``flwr-clientapp``: a SuperNode starts one per message), else 0.0.

    In a deployment the process start, imports (torch, fedcomp), pulling the message from the
    SuperNode and loading the partition come on top of ``train-seconds`` in every round
    (``benchmarks/links.py`` measures them); ``compression_mod`` reports this
    at the end of its work as ``clientapp-seconds`` and the round-time model counts the larger of it
    and train + compress seconds. In Flower's simulation and in-process runs the worker process
    serves many messages, and 0.0 is returned. Linux ``/proc`` (start time in clock ticks since
    boot, 10 ms steps); 0.0 where it cannot be read.
    """
    import os
    import sys

    if os.path.basename(sys.argv[0] if sys.argv else "") != CLIENTAPP_PROCESS:
        return 0.0
    try:
        with open("/proc/self/stat") as fh:
            stat = fh.read()
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        # field 22 (starttime); the command name (field 2) may hold spaces: count from its ")"
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0
