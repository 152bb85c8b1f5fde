"""Every field a run writes into ``metrics.json`` is documented in ``docs/reference/metrics-json.md``
(two short in-process runs: the default codec, and client-level DP)."""

import json
import pathlib
import re

import pytest
from flwr.app import Context, RecordDict

from fedcomp.app.client_app import app as client_app
from fedcomp.app.server_app import main
from fedcomp.run.inprocess_grid import InProcessGrid

REPO = pathlib.Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "reference" / "metrics-json.md"


def _documented() -> set[str]:
    return set(re.findall(r"`([a-z0-9][a-z0-9-]*)`", DOC.read_text()))


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{}, {"dp": "client-level", "fraction-evaluate": 0.0}], ids=["default", "dp"])
def test_every_metrics_json_field_is_documented(tmp_path, extra):
    rc = {"num-server-rounds": 1, "results-dir": str(tmp_path), **extra}
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=rc)
    main(InProcessGrid(client_app, 3, rc), ctx)
    data = json.loads((tmp_path / "metrics.json").read_text())
    fields = set(data) | {k for r in data["rounds"] for k in r}
    codec_bytes = {k for k in fields if k.startswith("upload-bytes-")}  # `upload-bytes-<codec>`
    if data["privacy"]:
        fields |= set(data["privacy"])
    assert sorted(fields - codec_bytes - _documented()) == []
    resolved = data["resolved"]  # what the run's "auto" values became
    assert resolved["upload"]["compressor"] == "stc" and resolved["aggregation"] == "auto"
    if not extra:  # the app's default download: STC 5 %, seeded start, the correction off for plain SGD
        assert resolved["download"] == {"codec": "stc", "density": 0.05, "first-contact": "seeded",
                                        "catch-up": "smallest", "correction": 0.0,
                                        "max-copies": resolved["download"]["max-copies"]}
        assert resolved["download"]["max-copies"] >= 8
    assert "auto" not in json.dumps(resolved["download"])
