"""The data-parallel examples on two machines, launched with the how-tos' own two-machine commands.

Each ``torchrun`` node runs in its own Linux network namespace; the two reach each other only
through their veth pairs and a bridge shaped to 100 Mbit/s each way (``benchmarks/netshape.py``),
so the rendezvous, gloo's connections and every collective cross a network link, not loopback.
The commands are read from the ``bash`` blocks of ``docs/how-to/ddp-hook.md`` (c10d rendezvous) and
``docs/how-to/diloco.md`` (static rendezvous, ``--master-addr``): machine A's runs in namespace 0,
machine B's in namespace 1, with the pages' addresses and interface name swapped for the
namespaces' and a few flags appended that shorten the run. Each node runs in a directory of its
own, as on two machines. Needs root, ``ip`` and ``tc``; skips where a network namespace cannot be
made.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import netshape

REASON = netshape.unavailable()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(REASON is not None, reason=f"network namespaces: {REASON}")]

#: Mbit/s of every link, both directions
RATE = 100.0
#: the addresses of machines A and B and the interface name in the how-tos' commands
DOC_ADDRS, DOC_IFNAME = ("10.0.0.1", "10.0.0.2"), "eth0"
#: seconds both nodes together may take (they need 5 to 30); past it they are stopped and the test fails
DEADLINE = 120.0


@pytest.fixture
def topo():
    with netshape.Topology(2, up_mbps=RATE, down_mbps=RATE) as t:
        yield t


def documented_commands(page: str) -> list[list[str]]:
    """The two-machine commands of ``docs/how-to/<page>``, machine A's first: each command of its ``bash``
    blocks that runs ``torchrun --nnodes 2``, continuation lines joined, split into words as the shell does."""
    blocks = re.findall(r"^```bash\n(.*?)^```", (REPO / "docs" / "how-to" / page).read_text(), re.DOTALL | re.MULTILINE)
    lines = "".join(blocks).replace("\\\n", " ").splitlines()
    return [shlex.split(line) for line in lines if "torchrun --nnodes 2 " in line]


def ifname(topo: netshape.Topology, k: int) -> str:
    """The interface that holds node ``k``'s address in its namespace."""
    out = subprocess.run(["ip", "-n", topo.namespaces[k], "-o", "-4", "addr", "show"], capture_output=True,
                         text=True, check=True, timeout=30).stdout
    (name,) = [line.split()[1] for line in out.splitlines() if f" {topo.client_ips[k]}/" in line]
    return name


def localise(words: list[str], topo: netshape.Topology, k: int) -> tuple[dict[str, str], list[str]]:
    """A documented command as node ``k`` runs it: ``(environment, argv)``. The leading ``NAME=value`` words
    become the environment (``GLOO_SOCKET_IFNAME`` set to node ``k``'s interface), machine A's and B's
    addresses become the namespaces', ``torchrun`` this interpreter's and the script path the checkout's."""
    env = dict(w.split("=", 1) for w in words[:words.index("torchrun")])
    assert env == {"GLOO_SOCKET_IFNAME": DOC_IFNAME}, words
    env["GLOO_SOCKET_IFNAME"] = ifname(topo, k)
    argv = [sys.executable, "-m", "torch.distributed.run"]  # what the `torchrun` script runs
    for w in words[words.index("torchrun") + 1:]:
        for doc, real in zip(DOC_ADDRS, topo.client_ips):
            w = w.replace(doc, real)
        argv.append(str(REPO / w) if w.startswith("examples/") else w)
    return env, argv


def sent_bytes(topo: netshape.Topology, k: int) -> int:
    """Bytes node ``k`` sent onto the link, as its uplink's qdisc counted them (layer-2 headers included)."""
    return int(re.search(r"Sent (\d+) bytes", topo.qdisc_stats()[f"up-{k}"]).group(1))


def stop(topo: netshape.Topology, procs: list[subprocess.Popen]) -> None:
    """Stop every node still running and whatever it started: SIGTERM to each torchrun's process group
    (torchrun then stops its workers, which run in process groups of their own), SIGKILL after 15 s, then
    SIGKILL to any process left in the two namespaces (private to this test: all of them are its own)."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(15)
    for ns in topo.namespaces:
        left = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False,
                              timeout=30).stdout.split()
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(15)


def run_nodes(topo: netshape.Topology, page: str, extra: list[str], tmp_path: pathlib.Path) -> list[str]:
    """Run the two-machine commands of ``page`` with ``extra`` appended, machine A's in namespace 0 and
    directory ``tmp_path/node0``, B's in namespace 1 and ``tmp_path/node1``, both at once; wait for both
    (at most DEADLINE seconds), assert that each exited 0 and return each one's output."""
    commands = documented_commands(page)
    assert len(commands) == 2, commands
    procs, logs = [], []
    try:
        for k, words in enumerate(commands):
            env, argv = localise(words, topo, k)
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **env}  # a crash shows where
            cwd = tmp_path / f"node{k}"
            cwd.mkdir()
            logs.append(cwd / "torchrun.log")
            with open(logs[-1], "w") as log:
                procs.append(subprocess.Popen([*topo.exec_prefix(k), *argv, *extra], cwd=cwd, env=env, stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + DEADLINE
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
    finally:
        stop(topo, procs)
    outputs = [log.read_text() for log in logs]
    tails = ["".join(line for line in out.splitlines(keepends=True) if not line.startswith("frame #"))[-4000:]
             for out in outputs]  # C++ stack frames left out
    report = "\n".join(f"--- node {k} (exit {p.returncode}): {shlex.join(p.args)}\n{tail}"
                       for k, (p, tail) in enumerate(zip(procs, tails)))
    assert [p.returncode for p in procs] == [0, 0], report
    return outputs


def test_the_ddp_example_on_two_nodes_with_c10d_rendezvous(topo, tmp_path):
    steps = 20
    outs = run_nodes(topo, "ddp-hook.md", ["--steps", str(steps), "--log-every", "10", "--timeout", "30",
                                           "--metrics", "metrics.json"], tmp_path)
    # c10d numbers the nodes by their --local-addr: A's sorts first, so A is rank 0 (prints and writes)
    assert outs[0].count("MB/rank") == 2 and "MB/rank" not in outs[1]
    assert not (tmp_path / "node1" / "metrics.json").exists()
    data = json.loads((tmp_path / "node0" / "metrics.json").read_text())
    config, hook = data["config"], data["hook"]
    assert (config["world_size"], config["backend"], config["compressor"], config["density"]) == (2, "gloo",
                                                                                                  "stc", 0.01)
    assert data["final"]["step"] == steps and hook["step"] == steps
    # the first step is the hook's fp32 warm-up; each later one sends at most 1 % of fp32's bytes
    dense_step = hook["bytes_dense"] // steps
    assert 0 < hook["bytes_sent"] - dense_step <= (steps - 1) * dense_step / 100
    # what crossed the link: at least what the hook handed to gloo, at most 4 steps of fp32 allreduce
    # (A also broadcasts the initial model; the rest is rendezvous, gloo's handshake, TCP/IP headers)
    for k in range(2):
        assert hook["bytes_sent"] < sent_bytes(topo, k) < 4 * dense_step
    digests = data["parameter_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]


def test_the_diloco_example_on_two_nodes_with_static_rendezvous(topo, tmp_path):
    outs = run_nodes(topo, "diloco.md", ["--task", "digits", "--sync-every", "10", "--outer-steps", "3",
                                         "--timeout", "30", "--metrics", "metrics.json"], tmp_path)
    assert outs[0].count("outer step") == 3 and "outer step" not in outs[1]  # --node-rank 0 is rank 0
    assert not (tmp_path / "node1" / "metrics.json").exists()
    data = json.loads((tmp_path / "node0" / "metrics.json").read_text())
    assert (data["world_size"], data["compressor"], data["codec_options"]) == (2, "stc", {"density": 0.01})
    rows = data["outer_steps"]
    assert [r["inner_step"] for r in rows] == [10, 20, 30]
    fp32_exchange = 4 * data["parameters"]  # one fp32 pseudo-gradient
    assert 0 < rows[-1]["mb_sent"] * 1e6 / 3 <= fp32_exchange / 20
    assert rows[-1]["ratio_vs_ddp"] >= 10 * 20
    # what crossed the link: at least the three payloads, less than three fp32 exchanges (A also
    # broadcasts the initial model; the rest is rendezvous, gloo's handshake, TCP/IP headers)
    for k in range(2):
        assert rows[-1]["mb_sent"] * 1e6 < sent_bytes(topo, k) < 3 * fp32_exchange
    digests = data["parameter_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]
