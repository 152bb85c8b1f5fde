"""The benchmark scripts run (smoke test; their numbers are reported in the README, not asserted here
beyond sanity)."""

import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_codecs_benchmark_runs(tmp_path):
    out = tmp_path / "codecs.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "codecs.py"), "--sizes", "20000", "--repeats", "1",
                    "--real-rounds", "1", "--out", str(out)], check=True, capture_output=True, timeout=300)
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert {r["codec"] for r in rows} == {"none", "fp16", "bf16", "int8", "qsgd", "sign", "topk", "stc", "randomk",
                                          "eden", "powersgd"}
    real = {(r["codec"], r.get("unbiased", False), r.get("rank")): r["rel_l2_error"] for r in res["real_updates"]}
    assert real[("eden", False, None)] < 0.9 * real[("sign", False, None)]  # heavy-tailed client updates
    sign = next(r for r in rows if r["codec"] == "sign")
    assert 1.0 <= sign["bits_per_param"] < 1.05
    assert all(r["position_bits_over_bound"] < 1.1 for r in rows if "position_bits_over_bound" in r)


def test_federated_benchmark_quick_runs(tmp_path):
    out = tmp_path / "fed.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "federated.py"), "--quick", "--out", str(out),
                    "--figure", str(tmp_path / "fig.png")], check=True, capture_output=True, timeout=600)
    res = {r["case"]: r for r in json.loads(out.read_text())["results"]}
    assert set(res) == {"none", "sign+EF", "stc 0.01+EF"}
    assert res["none"]["compression_ratio"] < 1.01
    assert 25 < res["sign+EF"]["compression_ratio"] < 32
    assert res["stc 0.01+EF"]["compression_ratio"] > 200
    assert (tmp_path / "fig.png").stat().st_size > 10_000
