"""Peak memory (RSS) of one client round, as on an edge device: a fresh process imports the
ClientApp, runs one train round of the default CNN through ``compression_mod`` (CPU, 1 thread),
and reports its peak resident set size; a second fresh process that only imports the same modules
gives the baseline, so the difference is what the round itself costs.

Run: ``python benchmarks/client_memory.py [--compressor stc]``; prints a table and writes
``benchmarks/results/client_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

from outputs import shown  # benchmarks/outputs.py: paths printed relative to the repository

CHILD = r"""
import resource, sys, time, logging
import torch
torch.set_num_threads(1)
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, Metadata, RecordDict
from fedcomp.app.client_app import app
from fedcomp.task.models import build_model
logging.getLogger("flwr").setLevel(logging.WARNING)
mode, compressor = sys.argv[1], sys.argv[2]
if mode == "round":
    cfg = {"compressor": compressor, "server-round": 1}
    md = Metadata(run_id=1, message_id="m1", src_node_id=1, dst_node_id=7, reply_to_message_id="", group_id="1",
                  created_at=time.time(), ttl=3600.0, message_type="train")
    msg = Message(content=RecordDict({"arrays": ArrayRecord(build_model().state_dict()),
                                      "config": ConfigRecord(cfg)}), metadata=md)
    ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 10, "device": "cpu"},
                  state=RecordDict(), run_config={})
    t0 = time.perf_counter()
    reply = app(msg, ctx)
    assert not reply.has_error(), reply.error
    print(json.dumps({"seconds": time.perf_counter() - t0,
                      "upload": float(reply.content["metrics"]["upload-bytes"])}))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def run(mode: str, compressor: str) -> tuple[int, dict]:
    out = subprocess.run([sys.executable, "-c", "import json\n" + CHILD, mode, compressor], check=True,
                         capture_output=True, text=True, timeout=600).stdout.strip().splitlines()
    return int(out[-1]), (json.loads(out[-2]) if mode == "round" else {})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compressor", nargs="+", default=["stc", "sign", "none"])
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "client_memory.json"))
    args = ap.parse_args()
    base_kb, _ = run("import", "none")
    rows = []
    print(f"{'codec':<8} {'peak RSS MB':>12} {'import-only MB':>15} {'round adds MB':>14} {'round s':>8}")
    for c in args.compressor:
        kb, info = run("round", c)
        rows.append({"compressor": c, "peak_rss_mb": kb / 1024, "import_only_mb": base_kb / 1024,
                     "round_adds_mb": (kb - base_kb) / 1024, **info})
        r = rows[-1]
        print(f"{c:<8} {r['peak_rss_mb']:>12.1f} {r['import_only_mb']:>15.1f} {r['round_adds_mb']:>14.1f} "
              f"{r['seconds']:>8.2f}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {shown(out)}")


if __name__ == "__main__":
    main()
