"""No DP mode prints a log line twice: Opacus' module-level ``logging.basicConfig``
(``opacus/utils/module_utils.py``, reached by every ``import opacus...``, the accountants too) gave
the root logger a handler, so every record of Flower's propagating ``flwr`` logger printed twice,
DEBUG included. Each mode runs in a fresh interpreter: an import happens once per process."""

import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # one fresh interpreter and federation per DP mode

SCRIPT = """
import logging, sys
sys.path.insert(0, {bench!r})
from federated import run_one
rounds = run_one({cfg!r}, 2)
assert len(rounds) == 2, rounds
print("root handlers:", len(logging.getLogger().handlers), file=sys.stderr)
"""

MODES = {
    "dp-sgd": {"dp": "dp-sgd", "noise-multiplier": 0.5},
    "client-level": {"dp": "client-level", "clipping-norm": 5.0, "noise-multiplier": 0.1},
    "local": {"dp": "local", "clipping-norm": 5.0, "noise-multiplier": 0.1},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_no_dp_mode_prints_a_line_twice(mode):
    cfg = {"num-server-rounds": 1, "compressor": "sign", "batch-size": 64, **MODES[mode]}
    code = SCRIPT.format(bench=str(REPO / "benchmarks"), cfg=cfg)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    err = proc.stderr
    assert proc.returncode == 0, err[-3000:]
    assert "root handlers: 0" in err  # Opacus' basicConfig left no handler behind
    # Flower's strategy logs the round once; the doubled output repeated every record in
    # basicConfig's format ("12/01/2026 12:00:00:INFO:...")
    assert err.count("[ROUND 1/1]") == 1, err[-3000:]
    assert err.count("configure_train: Sampled 2 nodes") == 1, err[-3000:]
    assert not re.search(r"^\d\d/\d\d/\d{4} \d\d:\d\d:\d\d:", err, re.M), err[-3000:]
    assert "DEBUG" not in err

