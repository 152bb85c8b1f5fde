"""The benchmark scripts run (smoke test; their numbers are reported in the README, not asserted here
beyond sanity)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def run_benchmark(tmp_path: pathlib.Path, script: str, *args: str, timeout: int = 600) -> dict:
    """Run ``benchmarks/<script>`` with ``args`` and ``--out`` in ``tmp_path``; its JSON results."""
    out = tmp_path / pathlib.Path(script).with_suffix(".json").name
    subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args, "--out", str(out)], check=True,
                   capture_output=True, timeout=timeout)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_codecs_benchmark_runs(tmp_path):
    res = run_benchmark(tmp_path, "codecs.py", "--sizes", "20000", "--repeats", "1", "--real-rounds", "1", timeout=300)
    rows = res["rows"]
    assert {r["codec"] for r in rows} == {"none", "fp16", "bf16", "int8", "qsgd", "sign", "topk", "stc", "randomk",
                                          "eden", "powersgd"}
    real = {(r["codec"], r.get("unbiased", False), r.get("rank")): r["rel_l2_error"] for r in res["real_updates"]}
    assert real[("eden", False, None)] < 0.9 * real[("sign", False, None)]  # heavy-tailed client updates
    sign = next(r for r in rows if r["codec"] == "sign")
    assert 1.0 <= sign["bits_per_param"] < 1.05
    assert all(r["position_bits_over_bound"] < 1.1 for r in rows if "position_bits_over_bound" in r)


@pytest.mark.slow
def test_codecs_throughput_mode_reports_ratios(tmp_path):
    res = run_benchmark(tmp_path, "codecs.py", "--throughput", "--n", "20000", "--repeats", "1", timeout=300)
    assert res["n"] == 20000 and res["sum_ms"] > 0 and res["clone_ms"] > 0
    rows = {(r["codec"], r.get("density")): r for r in res["rows"]}
    assert {c for c, _ in rows} == {"none", "fp16", "bf16", "sign", "int8", "qsgd", "eden", "stc", "topk", "randomk"}
    for r in res["rows"]:
        assert r["encode_vs_sum"] == pytest.approx(r["encode_ms"] / res["sum_ms"])
        assert r["decode_vs_clone"] == pytest.approx(r["decode_ms"] / res["clone_ms"])
        assert r["decode_out_ms"] is not None and r["decode_out_ms"] > 0
    assert set(res["floors_ms"]) == {"draws", "abs_mean"} and min(res["floors_ms"].values()) > 0
    for r in res["rows"]:  # the floor that identical bytes pin, for the codecs that have one
        assert ("floor_vs_sum" in r) == (r["codec"] in ("int8", "qsgd", "sign"))
        if "floor" in r:
            assert r["floor_vs_sum"] == pytest.approx(res["floors_ms"][r["floor"]] / res["sum_ms"])


def _references() -> dict:
    return {p.name: p.read_bytes() for p in sorted((REPO / "benchmarks" / "results").glob("*.json"))
            } | {"figure": (REPO / "docs" / "accuracy_vs_bytes.png").read_bytes()}


@pytest.mark.slow
def test_federated_benchmark_quick_runs(tmp_path):
    """--quick writes its JSON and figure to the temporary folder, never over the references."""
    before = _references()
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "federated.py"), "--quick"], check=True,
                          capture_output=True, text=True, timeout=600, env=env)
    out = tmp_path / "fedcomp-benchmarks" / "federated-quick.json"
    assert f"wrote {out}" in proc.stdout and f"wrote {out.with_suffix('.png')}" in proc.stdout
    assert _references() == before
    res = {r["case"]: r for r in json.loads(out.read_text())["results"]}
    assert set(res) == {"none", "sign+EF", "stc 0.01+EF"}
    assert res["none"]["compression_ratio"] < 1.01
    assert 25 < res["sign+EF"]["compression_ratio"] < 32
    assert res["stc 0.01+EF"]["compression_ratio"] > 200
    assert out.with_suffix(".png").stat().st_size > 10_000


@pytest.mark.slow
def test_plot_only_prints_the_table_and_draws_the_figure(tmp_path):
    ref = tmp_path / "federated.json"
    ref.write_bytes((REPO / "benchmarks" / "results" / "federated.json").read_bytes())
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "federated.py"), "--plot-only", str(ref)],
                          check=True, capture_output=True, text=True, timeout=300)
    assert "| dirichlet | sign+EF |" in proc.stdout and f"wrote {ref.with_suffix('.png')}" in proc.stdout
    assert ref.with_suffix(".png").stat().st_size > 10_000


def test_quick_outputs_never_name_a_reference():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from outputs import RESULTS, output_path, shown

    for name in ("federated", "privacy", "scale", "distributed_dp"):
        assert output_path(name, None, quick=False) == RESULTS / f"{name}.json"
        assert (RESULTS / f"{name}.json").exists()
        assert RESULTS not in output_path(name, None, quick=True).parents
        assert output_path(name, "mine.json", quick=True) == pathlib.Path("mine.json")  # --out: on purpose
    assert shown(RESULTS / "codecs.json") == "benchmarks/results/codecs.json"  # no machine path in README output


@pytest.mark.slow
def test_scale_benchmark_smoke_runs(tmp_path):
    res = run_benchmark(tmp_path, "scale.py", "--smoke", "--codecs", "stc,sign")
    rows = {(r["codec"], r["clients"], r["path"]): r for r in res["server"]}
    assert set(rows) == {(c, n, p) for c in ("stc", "sign") for n in (4, 12) for p in ("streaming", "dense")}
    for c in ("stc", "sign"):  # the dense path grows with the clients, the streaming one does not
        assert rows[(c, 12, "dense")]["peak_growth_x_model"] > rows[(c, 12, "streaming")]["peak_growth_x_model"]
    assert {r["codec"] for r in res["client"]} == {"stc", "sign"}
    assert all(r["seconds"] > 0 and r["codec_seconds"] > 0 for r in res["client"])


def test_scale_corrections_argument_is_refused_in_one_line_before_any_run():
    """Found by a new user: '--corrections yes' was a traceback, '2' or 'nan' a child's nested
    traceback after the runs started, and '0,0' silently duplicated rows (and mispaired the ratios)."""
    import argparse

    sys.path.insert(0, str(REPO / "benchmarks"))
    from scale import corrections_arg

    assert corrections_arg("0,1") == (0.0, 1.0) and corrections_arg("0.5") == (0.5,)
    for bad in ("yes", "", "0.5,", "nan", "-1", "2", "inf", "0,0", "1,1.0"):
        with pytest.raises(argparse.ArgumentTypeError):
            corrections_arg(bad)


@pytest.mark.slow
def test_scale_benchmark_downstream_smoke_runs(tmp_path):
    """--only-downstream --smoke: the server with the default download over 4 rounds, 10 % of 20 and 60
    nodes a round, without and with the downstream correction; written to the temporary folder, never
    over the reference."""
    before = _references()
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "scale.py"), "--smoke", "--only-downstream",
                           "--corrections", "0,1"],
                          check=True, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    out = tmp_path / "fedcomp-benchmarks" / "scale-quick.json"
    assert f"wrote {out}" in proc.stdout and _references() == before
    rows = {(r["nodes"], r["correction"], r["round"]): r for r in json.loads(out.read_text())["downstream_correction"]}
    assert set(rows) == {(n, c, r) for n in (20, 60) for c in (0.0, 1.0) for r in range(1, 5)}
    for (n, c, r), row in rows.items():
        assert (row["downstream"], row["downstream_density"]) == ("stc", 0.05)  # what "auto" resolves to
        assert row["sampled"] == n // 10 == sum(row["kinds"].values())
        assert row["copy_budget"] >= 256 / row["model_mib"] > 8  # a small model: what 256 MiB holds, past 8
        assert row["copies_kept"] <= row["copy_budget"]  # whatever the nodes
        assert row["nodes_known"] <= min(n, r * n // 10)
        assert 0 < row["download_x_model_per_node"] < 0.5  # the int8 start (1/4) and a 5 % diff at most
        assert row["configure_seconds"] > 0 and row["aggregate_seconds"] > 0
        if c == 1.0:  # paired with the uncorrected run: the same nodes sampled, the same kinds of message
            off = rows[(n, 0.0, r)]
            assert row["kinds"] == off["kinds"] and row["nodes_known"] == off["nodes_known"]
            assert row["aggregate_seconds_x_uncorrected"] > 0
        else:
            assert "aggregate_seconds_x_uncorrected" not in row
    assert rows[(20, 0.0, 1)]["kinds"] == {"init": 2} and rows[(60, 1.0, 1)]["kinds"] == {"init": 6}  # first contact


def test_secagg_benchmark_quick_runs(tmp_path):
    rows = {r["label"]: r for r in run_benchmark(tmp_path, "secagg.py", "--quick", "--skip-dense")["rows"]}
    assert len(rows) == 4
    k = round(0.0625 * 38282)  # 4 clients: modulus 2**19 (4 * 2**16 + 1 > 2**18), 15-byte headers, weight entry
    packed = rows["SecAgg+ randomk d=0.0625, packed"]
    assert packed["modulus-bits"] == 19
    assert packed["bits-per-parameter"] == 8 * (15 + (k * 19 + 7) // 8 + 15 + 3) / 38282
    assert rows["SecAgg+ randomk d=0.0625, int64"]["bits-per-parameter"] > 4.0


def test_secagg_benchmark_sweep_quick_runs(tmp_path):
    """The bits sweep: one row per density, quantization bits and clipping range, modulus auto."""
    rows = run_benchmark(tmp_path, "secagg.py", "--quick", "--alone", "--sweep", "1/16,3,0.05", "1/16,3,0.05,4")["rows"]
    assert [r["label"] for r in rows] == ["SecAgg+ secagg = true alone",
                                          "SecAgg+ randomk d=0.0625, 3-bit, c=0.05, packed + rotation",
                                          "SecAgg+ randomk d=0.0625, 3-bit, c=0.05, packed + rotation, server-lr 4"]
    k = round(0.0625 * 38282)
    for r in rows[1:]:
        assert (r["density"], r["quantization-bits"], r["clipping-range"]) == (0.0625, 3, 0.05)
        assert r["modulus-bits"] == 6  # 4 clients, Q = 2**3: ceil(log2(4 * 8 + 1))
        assert r["bits-per-parameter"] == 8 * (15 + (k * 6 + 7) // 8 + 15 + 1) / 38282
    assert [r["server-lr"] for r in rows[1:]] == [1.0, 4.0]
    k = round(0.07 * 38282)  # secagg = true alone: density 0.07, 3 bits, modulus 6 bits for 4 clients
    assert rows[0]["bits-per-parameter"] == 8 * (15 + (k * 6 + 7) // 8 + 15 + 1) / 38282
    assert len(rows[0]["accuracy-every-10-rounds"]) == 1  # one seed (2 rounds: no multiple of 10)


@pytest.mark.slow
def test_distributed_dp_benchmark_quick_runs(tmp_path):
    res = run_benchmark(tmp_path, "distributed_dp.py", "--quick", "--epsilons", "50")
    rows = {r["label"]: r for r in res["rows"]}
    assert len(rows) == 3 and res["threshold"] == 3  # 4 clients: threshold round(0.7 * 4) = 3
    for r in rows.values():  # each row's z is calibrated to the target by its own accountant
        assert r["epsilon"] == pytest.approx(50.0, rel=1e-3)
    ddp = rows["distributed DP under SecAgg+ (Skellam shares)"]
    assert ddp["sum-noise-std-over-clip"] == pytest.approx(ddp["noise-multiplier"] * (4 / 3) ** 0.5)
    assert (ddp["bits-per-parameter"]
            == rows["central client-level DP under SecAgg+ (server noise)"]["bits-per-parameter"])


@pytest.mark.slow
def test_memory_share_benchmark_quick_runs(tmp_path):
    res = run_benchmark(tmp_path, "memory_share.py", "--quick", "--codecs", "sign")
    rows = {r["residual-dtype"]: r for r in res["rows"]}
    model = res["plain"][0]["model_bytes"]  # 1/4-width ResNet-18: 4 bytes per float entry
    assert rows["fp32"]["residual-bytes"] == model and rows["fp16"]["residual-bytes"] == model / 2
    assert all(r["peak-bytes"] > res["plain"][0]["base_bytes"] for r in rows.values())


def test_both_ways_counts_bytes_to_fp32s_accuracy_minus_one_point():
    """Bytes both ways until fp32's median final accuracy minus 1 point, first model included."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from both_ways import bytes_to, summarize

    def run(case, seed, curve, sent):
        return {"case": case, "seed": seed, "final_accuracy": curve[-1], "upload_bytes": sum(sent) / 2,
                "download_bytes": sum(sent) / 2, "first_download_bytes": sent[1] / 2, "fp32_one_way_bytes": 300.0,
                "accuracy_curve": curve, "bytes_both_ways_curve": sent}

    fp32 = [run("fp32 both ways", s, [0.1, 0.8, 0.9], [0.0, 300.0, 300.0]) for s in (1, 2)]
    small = run("small", 1, [0.1, 0.85, 0.95], [0.0, 10.0, 5.0])
    never = run("never", 1, [0.1, 0.5, 0.88], [0.0, 1.0, 1.0])
    assert bytes_to(small, 0.89) == 15.0 and bytes_to(small, 0.85) == 10.0 and bytes_to(never, 0.89) is None
    rows = {s["case"]: s for s in summarize([*fp32, small, never])}
    assert rows["fp32 both ways"]["bytes_to_fp32_minus_1pt"] == 600.0  # 0.9 - 0.01 first reached at round 2
    assert rows["small"]["ratio_to_fp32_minus_1pt"] == 40.0
    assert rows["never"]["bytes_to_fp32_minus_1pt"] is None and rows["never"]["ratio_to_fp32_minus_1pt"] is None
    assert rows["small"]["last3_accuracy"] == pytest.approx((0.1 + 0.85 + 0.95) / 3)
    assert rows["small"]["ratio_both_ways"] == 40.0  # 2 x 300 fp32 bytes one way / 15


@pytest.mark.slow
def test_both_ways_resnet_quick_run_and_merge(tmp_path):
    """``--model resnet --quick`` writes ``both_ways_resnet-quick.json`` in the temporary folder (never
    the reference); ``--merge`` joins runs of separate processes and keeps every run."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "benchmarks")])}
    script = str(REPO / "benchmarks" / "both_ways.py")
    subprocess.run([sys.executable, script, "--model", "resnet", "--quick", "--nodes", "3"], check=True,
                   capture_output=True, text=True, timeout=600, env=env)
    out = tmp_path / "fedcomp-benchmarks" / "both_ways_resnet-quick.json"
    res = json.loads(out.read_text())
    rows = {s["case"]: s for s in res["summary"]}
    assert list(rows) == ["fp32 both ways", "sign up, auto down"] and res["rounds"] == 3
    assert rows["fp32 both ways"]["ratio_both_ways"] == pytest.approx(2 * res["runs"][0]["fp32_one_way_bytes"] / (
        res["runs"][0]["upload_bytes"] + res["runs"][0]["download_bytes"]))
    # sign up (1 bit a parameter) and STC 5 % down, seeded first model: more than 10x fewer bytes both ways
    assert rows["sign up, auto down"]["ratio_both_ways"] > 10
    assert rows["sign up, auto down"]["first_download_bytes"] < rows["fp32 both ways"]["first_download_bytes"] / 20
    merged = tmp_path / "merged.json"
    subprocess.run([sys.executable, script, "--model", "resnet", "--merge", str(out), str(out), "--out", str(merged)],
                   check=True, capture_output=True, text=True, timeout=120, env=env)
    assert len(json.loads(merged.read_text())["runs"]) == 2 * len(res["runs"])


@pytest.mark.slow
def test_clientapp_process_benchmark_quick_runs(tmp_path):
    """Both sides answer a train message; only the uncached side imports the partitioning libraries."""
    res = run_benchmark(tmp_path, "clientapp_process.py", "--quick", timeout=600)
    assert res["repeats"] == 2
    assert all(r["heavy"] == [] for r in res["runs"]["cached"])
    assert all(r["heavy"] == ["datasets", "flwr_datasets", "sklearn"] for r in res["runs"]["uncached"])
    assert all(r["cpu"] > 0 and r["wall"] > 0 for side in res["runs"].values() for r in side)
    assert res["ratio_uncached_over_cached"]["cpu"] == pytest.approx(
        res["median"]["uncached"]["cpu"] / res["median"]["cached"]["cpu"])


@pytest.mark.slow
def test_wire_benchmark_quick_counts_as_an_outside_grid_does(tmp_path):
    res = run_benchmark(tmp_path, "wire.py", "--quick", timeout=900)
    rows = {r["case"]: r for r in res["medians"]}
    assert len(rows) == 19 and len(res["table"]["rows"]) == 19
    counted = [r for r in rows.values() if r["reported-over-counted"] is not None]  # runs with fedcomp's own count
    assert len(counted) == 15 and all(r["reported-over-counted"] == pytest.approx(1.0, abs=1e-9) for r in counted)
    assert rows["reference: defaults"]["ratio"] > 50 and rows["existing app + two lines, sign"]["ratio"] > 25
