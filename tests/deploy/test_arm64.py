"""An arm64 SuperNode (Debian 12 aarch64 root file system, fedcomp's core from PyPI's aarch64 wheels, run
under qemu-user emulation) joins a real amd64 SuperLink next to an amd64 SuperNode and completes two rounds
of the default federation with STC; the server's metrics.json shows which machines replied.

Runs only with ``FEDCOMP_ARM64=1``: it needs root, Debian's mirror and PyPI (the first setup; later runs reuse
``$FEDCOMP_ARM64_ROOT``, default build/arm64-root in the repository), and the setup and the emulated run take minutes.
Marker ``arm64``: ``FEDCOMP_ARM64=1 pytest -m arm64``.
"""

import json
import os
import pathlib
import subprocess
import time

import pytest

from fedcomp.data import DataConfig
from fedcomp.datafiles import save_partitions
from fedcomp.deploy import main as deploy_main

from .helpers import free_port_block

pytestmark = [pytest.mark.arm64]

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "arm64_rootfs.sh"


def test_arm64_supernode_joins_an_amd64_superlink(tmp_path, capsys):
    if os.environ.get("FEDCOMP_ARM64") != "1":
        pytest.skip("emulated arm64 run: set FEDCOMP_ARM64=1 (root; minutes)")
    if os.geteuid() != 0:
        pytest.skip("qemu binfmt registration and chroot need root")
    root = pathlib.Path(os.environ.get("FEDCOMP_ARM64_ROOT", SCRIPT.parents[1] / "build" / "arm64-root"))
    t0 = time.monotonic()
    setup = subprocess.run([str(SCRIPT), "setup", str(root)], capture_output=True, text=True, timeout=1800,
                           check=False)
    assert setup.returncode == 0, setup.stdout[-2000:] + setup.stderr[-3000:]
    setup_s = time.monotonic() - t0
    machine = subprocess.run([str(SCRIPT), "exec", str(root), "python3", "-c", "import platform; print(platform.machine())"],
                             capture_output=True, text=True, timeout=120, check=False)
    assert machine.stdout.strip() == "aarch64", machine.stderr
    save_partitions(DataConfig(), 2, root / "data")  # the device's own data: partition 0 of 2
    base = free_port_block(3)
    try:
        code = deploy_main([
            "--app", str(REPO), "--port", str(base), "--base-node-port", str(base + 1), "--workdir", str(tmp_path),
            "--timeout", "1500", "--supernodes", "2",
            "--node-wrapper", f"0={SCRIPT} exec {root}", "--node-config", "0=data-file='/data/partition-0.npz'",
            "--run-config", "num-server-rounds=2 compressor='stc'"])
    finally:
        subprocess.run([str(SCRIPT), "umount", str(root)], check=False, timeout=60)
    out = capsys.readouterr().out
    logs = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(tmp_path.glob("*.log")))
    assert code == 0, out[-2000:] + logs
    rounds = json.loads((tmp_path / "results" / "metrics.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    for r in rounds[1:]:
        assert r["num-replies"] == 2 and r["upload-bytes"] == r["upload-bytes-stc"] > 0
        assert r["client-machines"] == {"aarch64": 1, "x86_64": 1}
        assert r["client-peak-rss-mb"] > 50.0
    print(f"arm64: setup {setup_s:.0f} s, federation {time.monotonic() - t0 - setup_s:.0f} s")
