"""benchmarks/llm.py --part full --quick runs (on the small local corpus) and never touches the committed results."""

import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_llm_benchmark_full_part_quick_runs(tmp_path, corpus):
    out = tmp_path / "llm.json"
    out.write_text(json.dumps({"lora": {"kept": True}}))  # another part's results stay in the file
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "llm.py"), "--part", "full", "--quick",
                           "--test-windows", "8", "--out", str(out), "--figure", str(tmp_path / "fig.png")],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["lora"] == {"kept": True}
    rows = {r["case"]: r for r in data["full"]["results"]}
    assert set(rows) == {"fp32", "stc 0.01+EF"} and data["full"]["setup"]["nodes"] == 3
    assert 0.99 < rows["fp32"]["compression_ratio"] < 1.01 and rows["fp32"]["rounds"] == 2
    assert rows["stc 0.01+EF"]["compression_ratio"] > 200  # ~0.1 bit per parameter
    assert rows["stc 0.01+EF"]["upload_reduction_vs_fp32"] > 200
    assert len(rows["fp32"]["accuracy_curve"]) == 3 and rows["fp32"]["accuracy_curve"][-1] > 0.05
    assert (tmp_path / "fig.png").stat().st_size > 10_000
    assert "| fp32 |" in proc.stdout
