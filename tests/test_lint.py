"""Lines of at most 120 characters (``[tool.ruff] line-length`` in pyproject.toml), as CI's linter enforces.

Runs ``python -m ruff check --select E501`` over the code CI lints: the library, the tests, the
benchmarks, the examples and the docs' build hooks. Ruff comes with the ``dev`` extra; without it
the test is skipped.
"""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

#: what CI lints, relative to the repository root
LINTED = ["fedcomp", "tests", "benchmarks", "examples", "docs/hooks"]


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                    reason="ruff is not installed (pip install -e '.[dev]' brings it)")
def test_no_line_is_longer_than_the_configured_limit():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "E501", "--no-cache",
                          "--output-format", "concise", *LINTED],
                         cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode in (0, 1), f"ruff did not run (exit {out.returncode}):\n{out.stderr}{out.stdout}"
    long_lines = [line for line in out.stdout.splitlines() if "E501" in line]
    if out.returncode or long_lines:
        pytest.fail(f"{len(long_lines)} lines over the limit (wrap them inside brackets; split strings by implicit "
                    "concatenation):\n" + "\n".join(long_lines), pytrace=False)
