"""What an edge device installs and pays: fedcomp's core (``pip install -c constraints.txt .``, no
extras) in a fresh virtual environment, measured.

Reports the venv's size on disk (and its largest packages), which extras' modules are absent,
``import fedcomp.compression`` time and peak RSS (median of fresh processes), and the peak RSS of one
ClientApp train round (default CNN, STC, CPU, 1 thread) run by the core venv's Python on a partition
file (``data-file`` node config, written beforehand by this interpreter, which has the ``data`` extra).

Run: ``python benchmarks/core_install.py`` (a few minutes: it installs torch into the new venv);
prints a table and writes ``benchmarks/results/core_install.json``. ``--keep DIR`` reuses/keeps the venv.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
#: modules of the extras (and of Flower's simulation extra) that a core install must not have
EXTRA_MODULES = ("ray", "matplotlib", "sklearn", "scipy", "opacus", "flwr_datasets", "datasets", "pandas", "pyarrow")

# Peak RSS from /proc/self/status VmHWM, not getrusage's ru_maxrss: Linux keeps ru_maxrss across
# fork + exec, so a child of a parent that has imported torch would report the parent's peak.
PEAK = "int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) / 1024"

IMPORT_CHILD = r"""
import time, json
t = time.perf_counter()
import fedcomp.compression
dt = time.perf_counter() - t
print(json.dumps({"seconds": dt, "rss_mb": PEAK}))
""".replace("PEAK", PEAK)

ROUND_CHILD = r"""
import json, sys, time, logging
import torch
torch.set_num_threads(1)
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, Metadata, RecordDict
from fedcomp.app.client_app import app
from fedcomp.task.models import build_model
logging.getLogger("flwr").setLevel(logging.WARNING)
data_file, compressor = sys.argv[1], sys.argv[2]
md = Metadata(run_id=1, message_id="m1", src_node_id=1, dst_node_id=7, reply_to_message_id="", group_id="1",
              created_at=time.time(), ttl=3600.0, message_type="train")
msg = Message(content=RecordDict({"arrays": ArrayRecord(build_model().state_dict()),
                                  "config": ConfigRecord({"compressor": compressor, "server-round": 1})}), metadata=md)
ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 10, "device": "cpu",
                                               "data-file": data_file}, state=RecordDict(), run_config={})
t0 = time.perf_counter()
reply = app(msg, ctx)
assert not reply.has_error(), reply.error
absent = []
for m in sys.argv[3:]:
    try:
        __import__(m)
    except ModuleNotFoundError:
        absent.append(m)
print(json.dumps({"seconds": time.perf_counter() - t0, "upload_bytes": float(reply.content["metrics"]["upload-bytes"]),
                  "peak_rss_mb": PEAK, "absent": absent}))
""".replace("PEAK", PEAK)


def du_mb(path: pathlib.Path) -> float:
    """Disk usage in MB (1e6 bytes) of a directory tree, as ``du -s`` (allocated blocks)."""
    out = subprocess.run(["du", "-s", "--block-size=1", str(path)], check=True, capture_output=True, text=True)
    return int(out.stdout.split()[0]) / 1e6


def make_core_venv(venv: pathlib.Path) -> float:
    """Create ``venv`` and install the repo's core into it; returns the seconds it took."""
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "-c", str(REPO / "constraints.txt"), str(REPO)],
                   check=True)
    return time.perf_counter() - t


def child_json(python: pathlib.Path, code: str, *args: str) -> dict:
    """Run ``code`` in the core venv from an empty folder (not the repo, not /tmp where Ray leaves a
    ``ray`` session folder that would import as a namespace package), without PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with tempfile.TemporaryDirectory() as cwd:
        out = subprocess.run([str(python), "-c", code, *args], check=True, capture_output=True, text=True,
                             timeout=900, cwd=cwd, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", default="", help="venv folder to create (or reuse if it exists) and keep")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "core_install.json"))
    args = ap.parse_args()
    from fedcomp.task.data import DataConfig
    from fedcomp.task.datafiles import save_partitions

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="fedcomp-core-"))
    venv = pathlib.Path(args.keep) if args.keep else tmp / "venv"
    try:
        install_s = None if (venv / "bin" / "python").exists() else make_core_venv(venv)
        py = venv / "bin" / "python"
        site = next((venv / "lib").glob("python3*/site-packages"))
        packages = sorted(((du_mb(p), p.name) for p in site.iterdir() if p.is_dir() and not p.name.endswith("-info")),
                          reverse=True)[:8]
        imports = [child_json(py, IMPORT_CHILD) for _ in range(args.repeats)]
        data_file = save_partitions(DataConfig(), 10, tmp / "partitions")[0]
        rnd = child_json(py, ROUND_CHILD, str(data_file), "stc", *EXTRA_MODULES)
        res = {
            "venv_mb": du_mb(venv), "install_seconds": install_s,
            "largest_packages_mb": {name: round(mb, 1) for mb, name in packages},
            "import_compression_seconds_median": statistics.median(r["seconds"] for r in imports),
            "import_compression_rss_mb_median": statistics.median(r["rss_mb"] for r in imports),
            "client_round": rnd, "extras_absent": rnd["absent"], "repeats": args.repeats,
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"core venv {res['venv_mb']:.0f} MB (largest: "
          + ", ".join(f"{k} {v:.0f}" for k, v in res["largest_packages_mb"].items()) + ")")
    print(f"import fedcomp.compression: {res['import_compression_seconds_median']:.2f} s, "
          f"peak RSS {res['import_compression_rss_mb_median']:.0f} MB (median of {args.repeats})")
    print(f"client train round (cnn, stc, 1 thread, data-file): peak RSS {rnd['peak_rss_mb']:.0f} MB, "
          f"{rnd['seconds']:.2f} s; extras absent: {', '.join(rnd['absent'])}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
