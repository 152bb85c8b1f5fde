"""What one Flower ClientApp process costs, with and without the SuperNode's partition cache.

In a deployment (``flower-supernode``, Docker Compose, an edge device) Flower starts a fresh
``flwr-clientapp`` process for every message. This benchmark runs what such a process runs for a
train message of the default federation: a fresh interpreter imports the ClientApp and answers one
train round (default CNN, STC, partition 0 of 10 of the digits, CPU, 1 thread), and reports the
process's wall seconds and CPU seconds (user + system, ``getrusage``) from start to exit:

- ``cached``: ``$FEDCOMP_DATA_DIR`` holds the partition file (:func:`fedcomp.task.datafiles.cached_partition`
  reads it; flwr-datasets, ``datasets`` and scikit-learn are not imported);
- ``uncached``: ``$FEDCOMP_DATA_DIR`` is a new empty folder every time (the partition is computed
  as before the cache: the first message of every node, and every message where the cache cannot
  be written).

Both sides alternate in one process, ``--repeats`` times each; the table gives medians and their
ratio (the machine is shared: compare the ratio, not the seconds).

Run: ``python benchmarks/clientapp_process.py [--repeats 5]``; writes
``benchmarks/results/clientapp_process.json`` (``--quick``: 2 repeats, written to the temp folder).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from outputs import output_path, shown  # benchmarks/outputs.py

CHILD = r"""
import json, logging, resource, sys, time
import torch
torch.set_num_threads(1)
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, Metadata, RecordDict
from fedcomp.app.client_app import app
from fedcomp.task.models import build_model
logging.getLogger("flwr").setLevel(logging.WARNING)
md = Metadata(run_id=1, message_id="m1", src_node_id=1, dst_node_id=7, reply_to_message_id="", group_id="1",
              created_at=time.time(), ttl=3600.0, message_type="train")
msg = Message(content=RecordDict({"arrays": ArrayRecord(build_model().state_dict()),
                                  "config": ConfigRecord({"compressor": "stc", "server-round": 1})}), metadata=md)
ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 10, "device": "cpu"},
              state=RecordDict(), run_config={})
reply = app(msg, ctx)
assert not reply.has_error(), reply.error
heavy = sorted(m for m in ("flwr_datasets", "datasets", "sklearn") if m in sys.modules)
u = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"cpu": u.ru_utime + u.ru_stime, "heavy": heavy}))
"""


def one(data_dir: str) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD], check=True, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "FEDCOMP_DATA_DIR": data_dir})
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return {"wall": time.perf_counter() - t0, **got}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2 repeats, written to the temp folder")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    repeats = 2 if args.quick else args.repeats
    runs: dict[str, list[dict]] = {"cached": [], "uncached": []}
    with tempfile.TemporaryDirectory() as tmp:
        warm = os.path.join(tmp, "warm")
        one(warm)  # fills the cache (and the OS page cache for both sides)
        for i in range(repeats):
            runs["cached"].append(one(warm))
            runs["uncached"].append(one(os.path.join(tmp, f"cold-{i}")))
    med = {side: {k: statistics.median(r[k] for r in rs) for k in ("wall", "cpu")} for side, rs in runs.items()}
    print(f"{'ClientApp process':<18} {'wall s':>8} {'CPU s':>8}  imports flwr-datasets/datasets/sklearn")
    for side, rs in runs.items():
        print(f"{side:<18} {med[side]['wall']:>8.2f} {med[side]['cpu']:>8.2f}  {rs[-1]['heavy'] or 'none'}")
    ratio = {k: med["uncached"][k] / med["cached"][k] for k in ("wall", "cpu")}
    print(f"{'uncached / cached':<18} {ratio['wall']:>8.2f} {ratio['cpu']:>8.2f}  (medians of {repeats}, alternating)")
    out = output_path("clientapp_process", args.out, args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"repeats": repeats, "median": med, "ratio_uncached_over_cached": ratio, "runs": runs,
                               "machine": platform.machine(), "cpus": os.cpu_count(),
                               "load_average": os.getloadavg()[0]}, indent=1) + "\n")
    print(f"wrote {shown(out)}")


if __name__ == "__main__":
    main()
