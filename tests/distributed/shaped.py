"""Running a benchmark's quick mode over shaped links (network namespaces; skipped where they cannot be
made): the smoke tests of the shaped-link benchmarks share it."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def run_quick(script: str, out: pathlib.Path, *args: str, timeout: float) -> str:
    """Run ``benchmarks/<script> --quick --out <out> <args>`` and return the JSON text it wrote; skip
    without shaped links (`netshape.unavailable`), fail with the output's tails on a non-zero exit."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import netshape

    if (reason := netshape.unavailable()) is not None:
        pytest.skip(f"shaped links: {reason}")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--quick", "--out", str(out), *args],
                          check=False, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out.read_text()
