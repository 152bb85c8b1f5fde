"""Scale: server aggregation memory and time for many clients, and the client's compression cost, at
ResNet-18 size (11.7M float32 parameters in 62 tensors plus BatchNorm buffers).

Server: ``CompressedStrategy(FedAvg).aggregate_train`` on N replies of one codec, each in a fresh
process so that peak RSS is its own (the replies are built first and the heap memory freed while
building them is handed back to the OS, :func:`trim_heap`; peak growth is measured from there, as a
multiple of the model's fp32 bytes). The streaming path (one running sum) and, for
N <= 32, the dense path (every reply decoded to dense weights, today's path for robust strategies)
run in the same invocation. Replies reuse a few distinct client updates (their bytes shared), so
building 1000 of them is cheap; the aggregation cannot tell.

Client: ``compress_update`` time and peak RSS growth per codec, against the codec alone (encode +
the error-feedback decode) and one ``torch.sum`` pass over the model, in the same process and
thread (one torch thread), timed in thread CPU seconds (``time.thread_time``: user + system time,
page faults included, but not the time other processes on a shared machine take the core away).

Downstream (``--only-downstream``): the server with the default download (run config ``downstream =
"auto"``: STC 5 % with server-side error feedback, compressed first contact, catch-ups) for ``--rounds``
rounds, ``--fraction`` of ``--nodes`` nodes sampled a round by Flower's FedAvg (seeded), each
sampled node replying with an stc 1/400 update: per round ``configure_train``'s and
``aggregate_train``'s time and peak RSS growth, the server's resident memory after the round (growth
from before round 1, freed heap handed back; the driver's one global model not counted), the copies
the sender keeps, the bytes each
node is sent and the kinds of message; one fresh process per repeat, medians over repeats.

Cross-device (``--flwr``): ``flwr run .`` with 100 SuperNodes and fraction-train 0.1 for 5 rounds on
the default data, private FLWR_HOME and ports; reports the wall time per round.

Run: ``python benchmarks/scale.py`` (about 20 min on 2 cores), ``--smoke`` (a small model, seconds),
``--only-client`` (the client table alone at full size, merged into the results file, about a minute),
``--only-server`` (the server rows of ``--codecs`` and ``--clients`` alone, merged into the results file),
``--only-downstream`` (the downstream rows alone, merged into the results file, about 6 min; with
``--corrections 0,1`` the same rows without and with ``Download(correction=1)``, paired per repeat,
under the key ``downstream_correction``);
prints tables and writes ``benchmarks/results/scale.json`` (``--smoke``: a file in the temporary folder). Medians
over ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

from outputs import output_path, shown

REPO = pathlib.Path(__file__).resolve().parents[1]
CODECS = {"stc": {"compressor": "stc", "density": 1 / 400}, "topk": {"compressor": "topk", "density": 0.01},
          "sign": {"compressor": "sign"}, "int8": {"compressor": "int8"}}


def resnet18_shapes(width: int = 64) -> dict[str, tuple[tuple[int, ...], str]]:
    """State_dict shapes and dtypes of a ResNet-18 (He et al. 2016) for 1000 classes; ``width`` 64 is
    the real one (11.69M parameters), smaller widths give the smoke model."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}

    def bn(name, c):
        for p in ("weight", "bias", "running_mean", "running_var"):
            out[f"{name}.{p}"] = ((c,), "float32")
        out[f"{name}.num_batches_tracked"] = ((), "int64")

    out["conv1.weight"] = ((width, 3, 7, 7), "float32")
    bn("bn1", width)
    cin = width
    for stage, mult in enumerate((1, 2, 4, 8), start=1):
        cout = width * mult
        for block in range(2):
            pre = f"layer{stage}.{block}"
            stride_in = cin if block == 0 else cout
            out[f"{pre}.conv1.weight"] = ((cout, stride_in, 3, 3), "float32")
            bn(f"{pre}.bn1", cout)
            out[f"{pre}.conv2.weight"] = ((cout, cout, 3, 3), "float32")
            bn(f"{pre}.bn2", cout)
            if block == 0 and stage > 1:
                out[f"{pre}.downsample.0.weight"] = ((cout, cin, 1, 1), "float32")
                bn(f"{pre}.downsample.1", cout)
        cin = cout
    out["fc.weight"] = ((1000, cin), "float32")
    out["fc.bias"] = ((1000,), "float32")
    return out


SERVER_CHILD = r"""
import json, sys, time, logging
import numpy as np, torch
sys.path.insert(0, sys.argv[1])
from scale import resnet18_shapes, make_replies, rss_mib, reset_peak, peak_mib, trim_heap
from flwr.serverapp.strategy import FedAvg
from fedcomp.download.round_hook import DownloadHook
from fedcomp.strategies import CompressedStrategy, Download
from fedcomp.statedict import FlatModel
logging.getLogger("flwr").setLevel(logging.ERROR)
spec = json.loads(sys.argv[2])
torch.set_num_threads(1)
shapes = resnet18_shapes(spec["width"])
rng = np.random.default_rng(0)
g = {k: (rng.standard_normal(s).astype(np.float32) * 0.05 if d == "float32" else np.array(7, np.int64))
     for k, (s, d) in shapes.items()}
model_bytes = 4 * sum(int(np.prod(s)) for s, d in shapes.values() if d == "float32")
strategy = CompressedStrategy(FedAvg(fraction_evaluate=0.0), aggregation=spec["path"], **spec["codec"])
replies = make_replies(g, strategy.codec, spec["clients"], distinct=spec["distinct"])
strategy.remember(1, FlatModel.from_numpy(g))
trim_heap()
base = rss_mib(); reset_peak()
t0 = time.perf_counter()
arrays, metrics = strategy.aggregate_train(1, replies)
sec = time.perf_counter() - t0
assert arrays is not None and metrics["num-replies"] == spec["clients"], metrics
print(json.dumps({"seconds": sec, "peak_growth_x_model": (peak_mib() - base) * 2**20 / model_bytes,
                  "model_mib": model_bytes / 2**20,
                  "payload_kib_per_client": metrics["upload-bytes"] / spec["clients"] / 1024}))
"""

CLIENT_CHILD = r"""
import json, statistics, sys, time, logging
import numpy as np, torch
sys.path.insert(0, sys.argv[1])
from scale import resnet18_shapes, rss_mib, reset_peak, peak_mib
import fedcomp.compression as fc
from fedcomp.client.update import compress_update
from fedcomp.config import CodecConfig
spec = json.loads(sys.argv[2])
torch.set_num_threads(1)
shapes = resnet18_shapes(spec["width"])
rng = np.random.default_rng(0)
g = {k: (rng.standard_normal(s).astype(np.float32) if d == "float32" else np.array(7, np.int64))
     for k, (s, d) in shapes.items()}
t = {k: (v + 0.01 * rng.standard_normal(v.shape).astype(np.float32) if v.dtype == np.float32 else v + 3)
     for k, v in g.items()}
codec = CodecConfig.from_mapping(spec["codec"])
model_bytes = 4 * sum(v.size for v in g.values() if v.dtype == np.float32)
res = {}
compress_update(g, t, codec, res)  # warm-up; its residual is the state a real round starts from
_, res, _ = compress_update(g, t, codec, {})
times = []
for _ in range(spec["repeats"]):
    base = rss_mib(); reset_peak()
    t0 = time.thread_time()
    _, new, stats = compress_update(g, t, codec, res)
    times.append(time.thread_time() - t0)
    growth = (peak_mib() - base) * 2**20
    res = new
resid = sum(r.nbytes for r in res.values())
# the codec alone on the same vectors: encode (+ EF decode) of each payload unit
from fedcomp.client.update import plan_units
units = plan_units({k: v.shape for k, v in g.items() if v.dtype == np.float32}, codec)
vecs = []
for ukey, members, name in units:
    vecs.append((torch.from_numpy(np.concatenate([(t[k] - g[k]).ravel() for k in members])), name))
codec_times = []
for _ in range(spec["repeats"]):
    t0 = time.thread_time()
    for x, name in vecs:
        p = codec.build(seed=1, compressor=name).compress(x)
        if fc.decompress_sparse(p) is None:
            fc.decompress(p)
    codec_times.append(time.thread_time() - t0)
main_times = []  # the default codec's payloads alone (stc/topk: the whole-model vector)
for _ in range(spec["repeats"]):
    t0 = time.thread_time()
    for x, name in vecs:
        if name == codec.compressor:
            p = codec.build(seed=1, compressor=name).compress(x)
            if fc.decompress_sparse(p) is None:
                fc.decompress(p)
    main_times.append(time.thread_time() - t0)
flat = torch.from_numpy(np.concatenate([v.ravel() for v in g.values() if v.dtype == np.float32]))
sum_times = []
for _ in range(spec["repeats"]):
    t0 = time.thread_time(); float(flat.sum()); sum_times.append(time.thread_time() - t0)
med = statistics.median
print(json.dumps({"seconds": med(times), "codec_seconds": med(codec_times), "sum_seconds": med(sum_times),
                  "default_codec_seconds": med(main_times), "sum_over_default_codec": med(sum_times) / med(main_times),
                  "ratio_to_codec": med(times) / med(codec_times),
                  "peak_growth_x_model": growth / model_bytes, "residual_x_model": resid / model_bytes}))
"""


DOWNSTREAM_CHILD = r"""
import collections, json, random, statistics, sys, time, logging
import numpy as np, torch
sys.path.insert(0, sys.argv[1])
from scale import resnet18_shapes, reply_records, replies_from, rss_mib, reset_peak, peak_mib, trim_heap
from flwr.app import ConfigRecord
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity
from fedcomp.app.resolve import resolve_downstream
from fedcomp.download.round_hook import DownloadHook
from fedcomp.strategies import CompressedStrategy, Download
from fedcomp.statedict import FlatModel
logging.getLogger("flwr").setLevel(logging.ERROR)
spec = json.loads(sys.argv[2])
torch.set_num_threads(1)
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 0  # Flower's Message needs them
random.seed(spec["seed"])  # Flower's FedAvg samples nodes with the random module
shapes = resnet18_shapes(spec["width"])
rng = np.random.default_rng(0)
g = {k: (rng.standard_normal(s).astype(np.float32) * 0.05 if d == "float32" else np.array(7, np.int64))
     for k, (s, d) in shapes.items()}
model_bytes = 4 * sum(int(np.prod(s)) for s, d in shapes.values() if d == "float32")
down, down_density = resolve_downstream("auto", 0.0, spec["codec"]["compressor"], "full", False)
strategy = CompressedStrategy(FedAvg(fraction_train=spec["fraction"], fraction_evaluate=0.0, min_train_nodes=1,
                                     min_available_nodes=1),
                              downstream=Download(down, density=down_density or None, correction=spec["correction"]),
                              **spec["codec"])
records = reply_records(g, strategy.codec, distinct=4)
# The synthetic replies stand for nodes that hold what they were sent but carry no digest of that copy:
# the server commits them unchecked (a real reply's check is one pass over the model, a tensor at a time).
import fedcomp.download.round_hook as round_hook
round_hook.reported_copy = lambda reply: None
next(h for h in strategy.hooks if isinstance(h, DownloadHook)).admit = lambda server_round, replies, sent: []
arrays = FlatModel.from_numpy(g).record(check=False)
del g

class Grid:
    def get_node_ids(self):
        return list(range(1, spec["nodes"] + 1))

grid = Grid()
x = lambda mib: mib * 2**20 / model_bytes
trim_heap(); start = rss_mib()
rounds = []
for r in range(1, spec["rounds"] + 1):
    trim_heap(); base = rss_mib(); reset_peak()
    t0 = time.perf_counter()
    msgs = list(strategy.configure_train(r, arrays, ConfigRecord(), grid))
    conf_s = time.perf_counter() - t0
    conf_peak = x(peak_mib() - base)
    ds = strategy.downstream
    sent = [ds.sent_bytes[m.metadata.dst_node_id] for m in msgs]
    kinds = dict(collections.Counter(ds.sent_kind.values()))
    by_kind = {k: statistics.mean(ds.sent_bytes[n] for n, kk in ds.sent_kind.items() if kk == k) / model_bytes
               for k in kinds}
    replies = replies_from(records, [m.metadata.dst_node_id for m in msgs])
    del msgs
    trim_heap(); base = rss_mib(); reset_peak()
    t0 = time.perf_counter()
    arrays, metrics = strategy.aggregate_train(r, replies)
    agg_s = time.perf_counter() - t0
    agg_peak = x(peak_mib() - base)
    assert arrays is not None and metrics["num-replies"] == len(replies), metrics
    del replies
    trim_heap()
    rounds.append({"round": r, "sampled": len(sent), "configure_seconds": conf_s, "configure_peak_x_model": conf_peak,
                   "aggregate_seconds": agg_s, "aggregate_peak_x_model": agg_peak,
                   "resident_x_model": x(rss_mib() - start),
                   "download_x_model_per_node": statistics.mean(sent) / model_bytes,
                   "download_kib_per_node": statistics.mean(sent) / 1024, "kinds": kinds,
                   "download_x_model_by_kind": by_kind,
                   "nodes_known": len(ds.nodes.node_version), "copies_kept": ds.nodes.copies(),
                   "copy_budget": ds.nodes.copy_budget()})
print(json.dumps({"model_mib": model_bytes / 2**20, "downstream": down, "downstream_density": down_density,
                  "rounds": rounds}))
"""


def rss_mib() -> float:
    """Current resident set size of this process (MiB, from /proc/self/status)."""
    return _status("VmRSS")


def peak_mib() -> float:
    """Peak resident set size since the last :func:`reset_peak` (MiB)."""
    return _status("VmHWM")


def reset_peak() -> None:
    """Reset the kernel's peak-RSS counter of this process (Linux ``/proc/self/clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def trim_heap() -> None:
    """Hand the heap memory freed so far back to the OS (glibc's ``malloc_trim``; nothing elsewhere), so
    that a peak measured from here counts what the call needs, not only what it could not take from
    pages freed before it (building the replies frees model-sized buffers)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def make_replies(g: dict, codec, clients: int, distinct: int = 4) -> list:
    """``clients`` compressed train replies (``distinct`` different client updates, reused), as
    ``compression_mod`` would send them; node ids 1..clients, weights 10..."""
    return replies_from(reply_records(g, codec, distinct), range(1, clients + 1))


def reply_records(g: dict, codec, distinct: int = 4) -> list[dict]:
    """The payload arrays of ``distinct`` different client updates of ``g`` (float tensors + 0.01 noise,
    integers + 3), compressed with ``codec`` as ``compression_mod`` would send them."""
    import numpy as np

    from fedcomp.client.update import compress_update
    from fedcomp.protocol.messages import payload_array

    rng = np.random.default_rng(1)
    records = []
    for _ in range(distinct):
        t = {k: (v + 0.01 * rng.standard_normal(v.shape).astype(np.float32) if v.dtype == np.float32 else v + 3)
             for k, v in g.items()}
        payloads, _, _ = compress_update(g, t, codec, {}, seed=1)
        records.append({k: payload_array(p) for k, p in payloads.items()})
    return records


def replies_from(records: list[dict], nodes) -> list:
    """One train reply per node id in ``nodes``, the i-th carrying ``records[i % len(records)]`` (the
    payload bytes shared, not copied), weights 10..16."""
    from flwr.app import ArrayRecord, Message, Metadata, MetricRecord, RecordDict

    out = []
    for i, node in enumerate(nodes):
        md = Metadata(run_id=1, message_id=f"r{i}", src_node_id=node, dst_node_id=0, reply_to_message_id="q",
                      group_id="1", created_at=time.time(), ttl=3600.0, message_type="train")
        content = RecordDict({"arrays": ArrayRecord(dict(records[i % len(records)])),
                              "metrics": MetricRecord({"num-examples": 10 + i % 7, "train-loss": 0.5})})
        out.append(Message(content=content, metadata=md))
    return out


def _child(code: str, spec: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", code, str(REPO / "benchmarks"), json.dumps(spec)],
                          capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def server_rows(width: int, clients: list[int], codecs: list[str], repeats: int, dense_max: int) -> list[dict]:
    rows = []
    for name in codecs:
        for n in clients:
            for path in ("auto", "dense"):
                if path == "dense" and n > dense_max:
                    continue
                runs = [_child(SERVER_CHILD, {"width": width, "clients": n, "codec": CODECS[name], "path": path,
                                              "distinct": 4}) for _ in range(repeats)]
                row = {"codec": name, "clients": n, "path": "streaming" if path == "auto" else "dense",
                       "seconds": statistics.median(r["seconds"] for r in runs),
                       "peak_growth_x_model": statistics.median(r["peak_growth_x_model"] for r in runs),
                       "model_mib": runs[0]["model_mib"], "payload_kib_per_client": runs[0]["payload_kib_per_client"]}
                rows.append(row)
                print(f"server {name:5s} {n:5d} clients {row['path']:9s} {row['seconds']:8.2f} s "
                      f"peak +{row['peak_growth_x_model']:6.2f}x model", flush=True)
    return rows


def client_rows(width: int, codecs: list[str], repeats: int) -> list[dict]:
    rows = []
    for name in codecs:
        r = _child(CLIENT_CHILD, {"width": width, "codec": CODECS[name], "repeats": repeats})
        rows.append({"codec": name, **r})
        print(f"client {name:5s} compress_update {r['seconds']:.3f} s = {r['ratio_to_codec']:.2f}x codec "
              f"({r['codec_seconds']:.3f} s), torch.sum {r['sum_seconds'] * 1e3:.1f} ms = "
              f"{r['sum_over_default_codec']:.3f}x the {name} payloads' encode + decode, peak RSS growth "
              f"{r['peak_growth_x_model']:.2f}x model (the new residual is {r['residual_x_model']:.2f}x)", flush=True)
    return rows


def downstream_rows(width: int, nodes: list[int], fraction: float, rounds: int, repeats: int,
                    corrections: tuple[float, ...] = (0.0,)) -> list[dict]:
    """The server with the default download (``downstream = "auto"``: STC 5 % with server-side error
    feedback, compressed first contact, catch-ups): ``rounds`` rounds of ``configure_train`` +
    ``aggregate_train`` with ``fraction`` of N nodes sampled a round (Flower's FedAvg, seeded), one
    fresh process per repeat and correction (``Download(correction=c)``) for each ``c`` in ``corrections``
    (the values alternate within each repeat, so that a busy machine slows them alike); per round the
    medians over repeats of each figure."""
    rows = []
    for n in nodes:
        runs = {c: [] for c in corrections}
        for seed in range(repeats):
            for c in corrections:
                runs[c].append(_child(DOWNSTREAM_CHILD, {"width": width, "nodes": n, "fraction": fraction,
                                                         "rounds": rounds, "codec": CODECS["stc"], "seed": seed,
                                                         "correction": c}))
        for c, i in ((c, i) for c in corrections for i in range(rounds)):
            per = [run["rounds"][i] for run in runs[c]]
            row = {"nodes": n, "fraction": fraction, "correction": c, "round": i + 1,
                   "model_mib": runs[c][0]["model_mib"],
                   "downstream": runs[c][0]["downstream"], "downstream_density": runs[c][0]["downstream_density"],
                   "kinds": per[0]["kinds"],  # the kinds of message sent in the first repeat, and their mean bytes
                   "download_x_model_by_kind": per[0]["download_x_model_by_kind"]}
            for key in ("sampled", "configure_seconds", "configure_peak_x_model", "aggregate_seconds",
                        "aggregate_peak_x_model", "resident_x_model", "download_x_model_per_node",
                        "download_kib_per_node", "nodes_known", "copies_kept", "copy_budget"):
                row[key] = statistics.median(p[key] for p in per)
            if c != 0.0 and 0.0 in runs:  # paired with the uncorrected run of the same repeat (same sampled nodes)
                pairs = [(run["rounds"][i], off["rounds"][i]) for run, off in zip(runs[c], runs[0.0])]
                row["aggregate_seconds_x_uncorrected"] = statistics.median(
                    p["aggregate_seconds"] / q["aggregate_seconds"] for p, q in pairs)
                row["aggregate_peak_minus_uncorrected_x_model"] = statistics.median(
                    p["aggregate_peak_x_model"] - q["aggregate_peak_x_model"] for p, q in pairs)
            rows.append(row)
            kinds = " ".join(f"{k}={v}" for k, v in sorted(row["kinds"].items()))
            print(f"downstream N={n:5d} c={c:g} round {row['round']:2d}: configure {row['configure_seconds']:6.2f} s "
                  f"peak +{row['configure_peak_x_model']:5.2f}x | aggregate {row['aggregate_seconds']:6.2f} s "
                  f"peak +{row['aggregate_peak_x_model']:5.2f}x | resident {row['resident_x_model']:5.2f}x "
                  f"(kept {row['copies_kept']:.2f}) | download {row['download_x_model_per_node']:.3f}x model/node "
                  f"[{kinds}]", flush=True)
    return rows


def cross_device(nodes: int = 100, rounds: int = 5) -> dict:
    """``flwr run .`` with ``nodes`` SuperNodes, fraction-train 0.1; wall seconds per round."""
    import shutil
    import tempfile

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="fedcomp-scale-"))
    env = {**os.environ, "FLWR_HOME": str(tmp / "flwr"), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": "39491", "FLWR_LOCAL_CONTROL_API_PORT": "39493"}
    flwr = shutil.which("flwr", path=str(pathlib.Path(sys.executable).parent)) or "flwr"
    cmd = [flwr, "run", str(REPO), "--stream", "--federation-config",
           f"num-supernodes={nodes} client-resources-num-cpus=1", "--run-config",
           f"num-server-rounds={rounds} fraction-train=0.1 min-train-nodes=2 results-dir='{tmp / 'results'}'"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    finally:
        from fedcomp.run.local_deployment import stop_local_superlink

        stop_local_superlink(tmp / "flwr")
    wall = time.perf_counter() - t0
    metrics = tmp / "results" / "metrics.json"
    if not metrics.exists():
        return {"completed": False, "log_tail": (proc.stdout + proc.stderr)[-2000:]}
    recs = json.loads(metrics.read_text())["rounds"]
    secs = [b["elapsed-seconds"] - a["elapsed-seconds"] for a, b in zip(recs, recs[1:])]
    return {"completed": len(recs) == rounds + 1, "nodes": nodes, "rounds": rounds, "wall_seconds": wall,
            "round_seconds_median": statistics.median(secs), "clients_per_round": recs[-1].get("num-replies"),
            "final_accuracy": recs[-1]["accuracy"]}


def corrections_arg(text: str) -> tuple[float, ...]:
    """``--corrections``: comma-separated distinct values in [0, 1] (argparse's type: a bad one is
    argparse's one-line error before any run)."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"numbers in [0, 1] separated by commas, got {text!r}") from None
    if not all(0.0 <= v <= 1.0 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"distinct numbers in [0, 1], got {text!r}")
    return values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="small model (width 8), 4 and 12 clients: seconds")
    ap.add_argument("--clients", default="10,100,1000")
    ap.add_argument("--codecs", default="stc,topk,sign,int8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--flwr", action="store_true", help="also run the 100-SuperNode flwr run simulation")
    ap.add_argument("--only-flwr", action="store_true", help="only the flwr run simulation (merged into --out)")
    ap.add_argument("--only-client", action="store_true",
                    help="only the client table at full size (merged into --out; with --smoke, a file in the "
                    "temporary folder)")
    ap.add_argument("--only-server", action="store_true",
                    help="only the server rows of --codecs and --clients (merged into --out by codec, clients and "
                    "path)")
    ap.add_argument("--only-downstream", action="store_true",
                    help="only the server with the default download over --rounds rounds, --nodes nodes in all, "
                    "--fraction sampled a round (merged into --out)")
    ap.add_argument("--nodes", default="100,1000", help="downstream: nodes in all")
    ap.add_argument("--fraction", type=float, default=0.1, help="downstream: fraction of the nodes sampled a round")
    ap.add_argument("--rounds", type=int, default=6, help="downstream: rounds")
    ap.add_argument("--corrections", default=(0.0,), type=corrections_arg,
                    help="downstream: the download's correction values in [0, 1], distinct, e.g. 0,1 "
                    "(each value its own process, alternating; ratios against 0 where it is listed)")
    ap.add_argument("--out", default=None, help="JSON to write (default: the reference benchmarks/results/scale.json; "
                    "with --smoke a file in the temporary folder)")
    args = ap.parse_args()
    width, clients, repeats = (8, [4, 12], 1) if args.smoke else (64, [int(c) for c in args.clients.split(",")],
                                                                 args.repeats)
    codecs = args.codecs.split(",")
    nodes = [20, 60] if args.smoke else [int(n) for n in args.nodes.split(",")]
    rounds = 4 if args.smoke else args.rounds
    corrections = args.corrections
    args.out = str(output_path("scale", args.out, args.smoke))
    if args.only_client:
        result = json.loads(pathlib.Path(args.out).read_text()) if pathlib.Path(args.out).exists() else {}
        result["client"] = client_rows(width, codecs, max(repeats, 3))
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {shown(pathlib.Path(args.out))}")
        return
    if args.only_server:
        result = json.loads(pathlib.Path(args.out).read_text()) if pathlib.Path(args.out).exists() else {"width": width}
        rows = server_rows(width, clients, codecs, repeats, dense_max=32)
        new = {(r["codec"], r["clients"], r["path"]) for r in rows}
        result["server"] = [r for r in result.get("server", [])
                            if (r["codec"], r["clients"], r["path"]) not in new] + rows
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {shown(pathlib.Path(args.out))}")
        return
    if args.only_downstream:
        result = json.loads(pathlib.Path(args.out).read_text()) if pathlib.Path(args.out).exists() else {"width": width}
        key = "downstream" if corrections == (0.0,) else "downstream_correction"  # keep the plain rows apart
        result[key] = downstream_rows(width, nodes, args.fraction, rounds, repeats, corrections)
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {shown(pathlib.Path(args.out))}")
        return
    if args.only_flwr:
        result = json.loads(pathlib.Path(args.out).read_text()) if pathlib.Path(args.out).exists() else {}
        result["cross_device"] = cross_device()
        print("cross-device:", result["cross_device"], flush=True)
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
        return
    result = {"width": width, "server": server_rows(width, clients, codecs, repeats, dense_max=32),
              "client": client_rows(width, codecs, max(repeats, 3)),
              "downstream": downstream_rows(width, nodes, args.fraction, rounds, repeats, corrections)}
    if args.flwr:
        result["cross_device"] = cross_device()
        print("cross-device:", result["cross_device"], flush=True)
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {shown(pathlib.Path(args.out))}")


if __name__ == "__main__":
    main()
