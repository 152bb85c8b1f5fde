"""Shaped links on one Linux machine: a bridge in the root network namespace and one network
namespace per client, each joined by a veth pair whose two ends carry a ``tbf`` qdisc, so every
client gets its own uplink and downlink rate (Linux ``ip netns``, ``ip link``, ``tc``; root only).

Topology (``Topology(2, up_mbps=1, down_mbps=10)``)::

    root namespace                            namespace <tag>n0            namespace <tag>n1
    bridge <tag>br  10.R.S.1/24 (SuperLink)
      +- veth <tag>h0 --tbf down_mbps-->  <--tbf up_mbps-- veth <tag>c0 10.R.S.2
      +- veth <tag>h1 --tbf down_mbps-->  <--tbf up_mbps-- veth <tag>c1 10.R.S.3

The uplink is the egress of the client's veth end (client -> root), the downlink the egress of
the root's end (root -> client): shaping on egress needs no ``ifb``. ``tc`` counts layer-2 bytes
(Ethernet + IP + TCP headers: about 4.6 % on top of the payload at MTU 1500), and ``mbit`` is
10^6 bit/s. ``tc``'s delay (``sch_netem``) is not available in every kernel (not here): a round-trip
time comes from :func:`relay`, a user-space TCP relay run inside the client's namespace that holds
each chunk RTT/2 in each direction before passing it on. All traffic stays on this machine: the bridge has no
other port and no route out.

Errors: :func:`unavailable` says why shaping cannot run here (not root, no ``ip``/``tc``, no
network namespaces); :class:`Topology` raises ``subprocess.CalledProcessError`` when a command
fails and removes what it created (also on interpreter exit, see :meth:`Topology.close`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ipaddress
import os
import pathlib
import secrets
import shutil
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _tc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["tc", *args], capture_output=True, text=True, check=True)


def unavailable() -> str | None:
    """Why shaped links cannot be built on this machine (a sentence), or None if they can.

    Checks: root, ``ip`` and ``tc`` on PATH, and that a network namespace with a ``tbf`` qdisc on
    a veth end can really be created (then removed).
    """
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (iproute2)"
    tag = "fcp" + secrets.token_hex(4)
    made_ns = made_link = False  # only what this probe created is removed (a name clash leaves others' alone)
    try:
        _ip("netns", "add", tag)
        made_ns = True
        _ip("link", "add", tag + "a", "type", "veth", "peer", "name", tag + "b")
        made_link = True
        _tc("qdisc", "add", "dev", tag + "a", "root", "tbf", "rate", "1mbit", "burst", "4kb", "latency", "100ms")
        _ip("link", "set", tag + "b", "netns", tag)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"cannot build a shaped veth pair in a network namespace: {getattr(e, 'stderr', e)}".strip()
    finally:
        if made_link:
            _ip("link", "del", tag + "a", check=False)
        if made_ns:
            _ip("netns", "del", tag, check=False)
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    """A random 10.x.y.0/24 that no interface of the root namespace uses."""
    used = _ip("-4", "-o", "addr", "show").stdout
    nets = [ipaddress.ip_interface(w).network for line in used.splitlines() for w in line.split()
            if "/" in w and w[0].isdigit()]
    for _ in range(200):
        net = ipaddress.ip_network(f"10.{secrets.randbelow(200) + 50}.{secrets.randbelow(254) + 1}.0/24")
        if not any(net.overlaps(n) for n in nets):
            return net
    raise RuntimeError("no free 10.x.y.0/24 subnet found")


def tbf_args(mbps: float) -> list[str]:
    """``tc qdisc ... tbf`` arguments for ``mbps`` megabits per second (10^6 bit/s).

    The bucket holds 5 ms of traffic (at least 2 full frames, so the rate is kept also for 64 kB
    GSO super-packets, which tbf segments) and the queue 200 ms, enough that TCP is not starved by
    drops at any of the tested rates.
    """
    if not mbps > 0:
        raise ValueError(f"link speed must be > 0 Mbit/s, got {mbps!r}")
    rate_bytes = mbps * 1e6 / 8
    burst = max(int(rate_bytes * 0.005), 3200)
    return ["tbf", "rate", f"{int(mbps * 1e6)}bit", "burst", str(burst), "latency", "200ms"]


class Topology:
    """A bridge with ``n`` shaped client namespaces (see the module docstring); a context manager.

    Parameters
    ----------
    n : int
        Number of client namespaces (>= 1, <= 200).
    up_mbps, down_mbps : float or None
        Rate of each client's uplink (client -> bridge) and downlink (bridge -> client) in Mbit/s;
        None leaves that direction unshaped.

    Attributes
    ----------
    host_ip : str
        The bridge's address in the root namespace (bind the server here).
    namespaces : list[str]
        Namespace names, one per client; ``exec_prefix(i)`` runs a command in namespace ``i``.
    client_ips : list[str]
        Each client's address inside its namespace.
    """

    def __init__(self, n: int, up_mbps: float | None, down_mbps: float | None) -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"1 <= n <= 200 client namespaces, got {n}")
        self.tag = "fcl" + secrets.token_hex(4)  # interface names <= 15 characters ("h199" last)
        self.bridge = self.tag + "br"
        self._bridge_made = False  # close() removes only what was created here
        self.namespaces: list[str] = []
        self._veths: list[str] = []
        atexit.register(self.close)
        try:
            net = _free_subnet()
            hosts = list(net.hosts())
            self.host_ip = str(hosts[0])
            self.client_ips = [str(hosts[i + 1]) for i in range(n)]
            _ip("link", "add", self.bridge, "type", "bridge")
            self._bridge_made = True
            _ip("addr", "add", f"{self.host_ip}/{net.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(n):
                ns, h, c = f"{self.tag}n{i}", f"{self.tag}h{i}", f"{self.tag}c{i}"
                _ip("netns", "add", ns)
                self.namespaces.append(ns)
                _ip("link", "add", h, "type", "veth", "peer", "name", c)
                self._veths.append(h)
                _ip("link", "set", h, "master", self.bridge)
                _ip("link", "set", h, "up")
                _ip("link", "set", c, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{self.client_ips[i]}/{net.prefixlen}", "dev", c)
                _ip("-n", ns, "link", "set", c, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                if down_mbps is not None:
                    _tc("qdisc", "add", "dev", h, "root", *tbf_args(down_mbps))
                if up_mbps is not None:
                    _tc("-n", ns, "qdisc", "add", "dev", c, "root", *tbf_args(up_mbps))
        except BaseException:
            self.close()
            raise

    def exec_prefix(self, i: int) -> list[str]:
        """Command prefix that runs a program in client namespace ``i``."""
        return ["ip", "netns", "exec", self.namespaces[i]]

    def qdisc_stats(self) -> dict[str, str]:
        """``tc -s qdisc`` of every shaped interface (bytes sent, drops, overlimits), for the log."""
        out = {}
        for i, ns in enumerate(self.namespaces):
            out[f"down-{i}"] = subprocess.run(["tc", "-s", "qdisc", "show", "dev", f"{self.tag}h{i}"],
                                              capture_output=True, text=True, check=False).stdout
            out[f"up-{i}"] = subprocess.run(["tc", "-n", ns, "-s", "qdisc", "show", "dev", f"{self.tag}c{i}"],
                                            capture_output=True, text=True, check=False).stdout
        return out

    def client_ifname(self, i: int) -> str:
        """The veth end inside client namespace ``i`` (what ``GLOO_SOCKET_IFNAME`` names there)."""
        return f"{self.tag}c{i}"

    def run_ranks(self, argvs: list[list[str]], logs: list[pathlib.Path], timeout: float,
                  env: dict[str, str] | None = None) -> list[int | None]:
        """Run ``argvs[i]`` in client namespace ``i``, all at once, and wait for them.

        Each process gets ``GLOO_SOCKET_IFNAME`` (its namespace's veth end, so gloo's traffic crosses
        the shaped link), one thread (``OMP_NUM_THREADS=1``) and the repository on ``PYTHONPATH``,
        over ``env`` (default: this process's environment); its stdout and stderr go to ``logs[i]``.
        A process still running ``timeout`` seconds after the start is killed, so that the namespaces
        can be removed.

        Returns
        -------
        list of int or None
            The exit codes, in namespace order (negative: killed by a signal).
        """
        base = dict(os.environ if env is None else env)
        path = os.pathsep.join(filter(None, [str(REPO), base.get("PYTHONPATH")]))
        procs = []
        try:
            for i, (argv, log) in enumerate(zip(argvs, logs)):
                child = {**base, "GLOO_SOCKET_IFNAME": self.client_ifname(i), "OMP_NUM_THREADS": "1",
                         "PYTHONPATH": path}
                with open(log, "w") as fh:
                    procs.append(subprocess.Popen([*self.exec_prefix(i), *argv], stdout=fh,
                                                  stderr=subprocess.STDOUT, env=child))
            deadline = time.monotonic() + timeout
            for p in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return [p.returncode for p in procs]

    @staticmethod
    def log_tails(codes: list[int | None], logs: list[pathlib.Path], chars: int = 3000) -> str:
        """The end of each process's log under its exit code: what a failed :meth:`run_ranks` reports."""
        return "\n".join(f"--- rank {r} (exit {code}):\n" + log.read_text()[-chars:]
                         for r, (code, log) in enumerate(zip(codes, logs)))

    def close(self) -> None:
        """Remove the namespaces (their veth pairs go with them) and the bridge; idempotent.
        Processes still running in a namespace keep it alive: stop them first."""
        for h in self._veths:
            _ip("link", "del", h, check=False)
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)
        if self._bridge_made:
            with contextlib.suppress(Exception):
                _ip("link", "del", self.bridge, check=False)
        self._veths, self.namespaces, self._bridge_made = [], [], False
        atexit.unregister(self.close)

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float, chunk: int,
                depth: int) -> None:
    """Copy ``reader`` to ``writer``, each chunk ``delay`` seconds after it was read, in order; at most
    ``depth`` chunks wait (bounded memory: reading pauses when the queue is full)."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=depth)

    async def read() -> None:
        try:
            while data := await reader.read(chunk):
                await queue.put((time.monotonic() + delay, data))
        finally:
            await queue.put(None)

    async def write() -> None:
        while (item := await queue.get()) is not None:
            due, data = item
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()

    await asyncio.gather(read(), write())


async def _serve(port: int, host: str, target_port: int, delay: float) -> None:
    async def handle(r_client: asyncio.StreamReader, w_client: asyncio.StreamWriter) -> None:
        try:
            r_up, w_up = await asyncio.open_connection(host, target_port)
        except OSError:
            w_client.close()
            return
        try:
            await asyncio.gather(_pump(r_client, w_up, delay, 65536, 64), _pump(r_up, w_client, delay, 65536, 64))
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for w in (w_up, w_client):
                w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def relay(port: int, host: str, target_port: int, rtt_ms: float) -> None:
    """Listen on 127.0.0.1:``port`` and relay every connection to ``host:target_port``, delaying each
    chunk by ``rtt_ms`` / 2 milliseconds in each direction (a request/response exchange then takes one
    RTT longer). Not a full link emulation: the relay's own TCP connections see no delay, so TCP's
    window growth is not slowed; what it adds is the latency of every exchange, which is what a
    polling, request-based protocol such as Flower's Fleet API pays per round. Runs until killed.
    Command line: ``python netshape.py relay PORT HOST TARGET_PORT RTT_MS``."""
    asyncio.run(_serve(port, host, target_port, rtt_ms / 2000.0))


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "relay":
    relay(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))
