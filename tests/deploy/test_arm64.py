"""An arm64 SuperNode (Debian 12's aarch64 Python 3.11 and fedcomp's core from PyPI's aarch64 wheels, run
under qemu-user emulation) joins a real amd64 SuperLink next to an amd64 SuperNode and completes two rounds
of the default federation with STC; the server's metrics.json shows which machines replied.

When it runs: as root, where qemu-user's aarch64 emulation is registered (``binfmt_misc``), unless
``FEDCOMP_ARM64=0``; ``FEDCOMP_ARM64=1`` (what ``.ci/run`` sets) requires it: the script installs
``qemu-user-static`` where it is missing, and anything that fails fails the test. The first setup needs
Debian's mirror and PyPI; later runs reuse ``$FEDCOMP_ARM64_ROOT`` (default build/arm64-root in the
repository). Marker ``arm64`` (and ``slow``): ``pytest -m arm64``; the README gives the measured times.
"""

import json
import os
import pathlib
import subprocess
import time

import pytest

from fedcomp.task.data import DataConfig
from fedcomp.task.datafiles import save_partitions
from fedcomp.run.local_deployment import main as deploy_main

from .helpers import free_port_block

pytestmark = [pytest.mark.arm64]

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "arm64_rootfs.sh"
BINFMT = pathlib.Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")


def arm64_wanted() -> tuple[bool, str]:
    """``(run, reason)``: whether this machine runs the emulated arm64 test (see the module docstring)."""
    flag = os.environ.get("FEDCOMP_ARM64", "")
    if flag == "0":
        return False, "FEDCOMP_ARM64=0"
    if flag == "1":
        return True, "FEDCOMP_ARM64=1"
    if os.geteuid() != 0:
        return False, "the emulated arm64 SuperNode needs root (chroot, binfmt_misc); FEDCOMP_ARM64=1 requires it"
    if not BINFMT.exists():
        return False, "qemu-user's aarch64 emulation is not registered (FEDCOMP_ARM64=1 installs it)"
    return True, "root, qemu-aarch64 registered"


@pytest.mark.slow
@pytest.mark.timeout(2700)
def test_arm64_supernode_joins_an_amd64_superlink(tmp_path, capsys):
    run, reason = arm64_wanted()
    if not run:
        pytest.skip(reason)
    assert os.geteuid() == 0, "FEDCOMP_ARM64=1, but qemu binfmt registration and chroot need root"
    root = pathlib.Path(os.environ.get("FEDCOMP_ARM64_ROOT", REPO / "build" / "arm64-root"))
    t0 = time.monotonic()
    setup = subprocess.run([str(SCRIPT), "setup", str(root)], capture_output=True, text=True, timeout=1200,
                           check=False)
    assert setup.returncode == 0, setup.stdout[-2000:] + setup.stderr[-3000:]
    setup_s = time.monotonic() - t0
    save_partitions(DataConfig(), 2, root / "data")  # the device's own data: partition 0 of 2
    base = free_port_block(3)
    t1 = time.monotonic()
    try:
        code = deploy_main([
            "--app", str(REPO), "--port", str(base), "--base-node-port", str(base + 1), "--workdir", str(tmp_path),
            "--timeout", "1500", "--supernodes", "2",
            "--node-wrapper", f"0={SCRIPT} exec {root}", "--node-config", "0=data-file='/data/partition-0.npz'",
            # no federated evaluation: each round is one emulated ClientApp process per node, not two
            "--run-config", "num-server-rounds=2 compressor='stc' fraction-evaluate=0.0"])
    finally:
        subprocess.run([str(SCRIPT), "umount", str(root)], check=False, timeout=60)
    out = capsys.readouterr().out
    logs = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(tmp_path.glob("*.log")))
    assert code == 0, out[-2000:] + logs
    assert not any(line.startswith(("proc ", "sysfs ")) and f" {root}/" in line
                   for line in pathlib.Path("/proc/mounts").read_text().splitlines()), "mounts left behind"
    rounds = json.loads((tmp_path / "results" / "metrics.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    for r in rounds[1:]:
        assert r["num-replies"] == 2 and r["upload-bytes"] == r["upload-bytes-stc"] > 0
        assert r["client-machines"] == {"aarch64": 1, "x86_64": 1}
        assert r["copy-resyncs"] == 0  # the aarch64 node's copy equals the x86_64 server's record, bit for bit
        assert r["client-peak-rss-mb"] > 50.0
    done = ", ".join(f"{r['elapsed-seconds']:.0f}" for r in rounds)
    with capsys.disabled():
        print(f"\narm64 ({reason}): setup {setup_s:.0f} s; federation {time.monotonic() - t1:.0f} s, rounds done at "
              f"{done} s (load {os.getloadavg()[0]:.1f})")
        print("\n".join(line for line in setup.stdout.splitlines() if line.startswith("arm64_rootfs:")))


@pytest.mark.parametrize("args", [["setup", "/"], ["umount", "//"], ["nonsense", "build/x"]])
def test_rootfs_script_refuses_the_host_root_and_unknown_commands(args, tmp_path):
    """``setup`` starts with ``rm -rf ROOT``: the host's / is refused before anything runs (any user)."""
    out = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=30, cwd=tmp_path, check=False)
    assert out.returncode == 2, out.stdout + out.stderr
    assert ("refusing ROOT '/'" if args[0] != "nonsense" else "usage:") in out.stderr
    assert not (tmp_path / "build").exists()
