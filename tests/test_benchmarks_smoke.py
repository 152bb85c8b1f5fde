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


def test_scale_benchmark_smoke_runs(tmp_path):
    out = tmp_path / "scale.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "scale.py"), "--smoke", "--codecs", "stc,sign",
                    "--out", str(out)], check=True, capture_output=True, timeout=600)
    res = json.loads(out.read_text())
    rows = {(r["codec"], r["clients"], r["path"]): r for r in res["server"]}
    assert set(rows) == {(c, n, p) for c in ("stc", "sign") for n in (4, 12) for p in ("streaming", "dense")}
    for c in ("stc", "sign"):  # the dense path grows with the clients, the streaming one does not
        assert rows[(c, 12, "dense")]["peak_growth_x_model"] > rows[(c, 12, "streaming")]["peak_growth_x_model"]
    assert {r["codec"] for r in res["client"]} == {"stc", "sign"}
    assert all(r["seconds"] > 0 and r["codec_seconds"] > 0 for r in res["client"])


def test_secagg_benchmark_quick_runs(tmp_path):
    out = tmp_path / "secagg.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "secagg.py"), "--quick", "--skip-dense", "--out", str(out)],
                   check=True, capture_output=True, timeout=600)
    rows = {r["label"]: r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == 4
    k = round(0.0625 * 38282)  # 4 clients: modulus 2**19 (4 * 2**16 + 1 > 2**18), 15-byte headers, weight entry
    packed = rows["SecAgg+ randomk d=0.0625, packed"]
    assert packed["modulus-bits"] == 19
    assert packed["bits-per-parameter"] == 8 * (15 + (k * 19 + 7) // 8 + 15 + 3) / 38282
    assert rows["SecAgg+ randomk d=0.0625, int64"]["bits-per-parameter"] > 4.0
