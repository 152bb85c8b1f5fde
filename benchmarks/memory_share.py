"""fedcomp's share of a client's memory at ResNet-18 size (11.7M float32 parameters): the peak RSS
of a client round through ``compression_mod`` minus the peak of the same round without it.

Each run is a fresh process (1 thread): a ResNet-18 (He et al. 2016, ImageNet layout, 1000 classes)
receives the global weights in a Flower train message, trains one SGD-momentum step on 8 images of
3x64x64 and replies with its weights (the training itself: model, gradients, momentum,
activations). ``plain`` calls that handler directly; ``mod`` calls it through ``compression_mod``
(received copy, update, error-feedback residual, payloads, codec buffers). Two rounds each, so that
round 2 starts with the residual of round 1 held; the peak is of round 2 (``/proc/self/clear_refs``
resets it). The difference of the two peaks, as a multiple of the model's fp32 bytes, is fedcomp's
share (target <= 2x); ``residual-bytes`` is the residual the client holds between rounds.

Run: ``python benchmarks/memory_share.py [--codecs stc sign topk]`` (about 2 min); prints a table and
writes ``benchmarks/results/memory_share.json`` (``--quick``: a 1/4-width ResNet-18, to the temporary folder).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from outputs import REPO, output_path, shown

CODECS = {"stc": {"compressor": "stc", "density": 1 / 400}, "topk": {"compressor": "topk", "density": 0.01},
          "sign": {"compressor": "sign"}}

CHILD = r"""
import gc, json, sys, time
import torch
from torch import nn
torch.set_num_threads(1)
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, Metadata, MetricRecord, RecordDict
sys.path.insert(0, sys.argv[1])
from fedcomp.client import compression_mod
from fedcomp.task.models import BasicBlock

spec = json.loads(sys.argv[2])

def status():
    return {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/self/status")
            if l.startswith(("VmHWM", "VmRSS"))}

def reset_peak():
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")

class ResNet18(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.conv1 = nn.Conv2d(3, w, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        blocks, cin = [], w
        for mult, stride in ((1, 1), (2, 2), (4, 2), (8, 2)):
            blocks += [BasicBlock(cin, w * mult, stride), BasicBlock(w * mult, w * mult)]
            cin = w * mult
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, 1000)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        return self.fc(self.blocks(x).mean(dim=(2, 3)))

model = ResNet18(spec["width"])
model_bytes = 4 * sum(p.numel() for p in model.state_dict().values() if p.dtype == torch.float32)
gen = torch.Generator().manual_seed(0)
x, y = torch.rand(8, 3, 64, 64, generator=gen), torch.randint(0, 1000, (8,), generator=gen)

def handler(msg, ctx):
    model.load_state_dict({k: torch.from_numpy(a.numpy()) for k, a in msg.content["arrays"].items()})
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    del opt
    model.zero_grad(set_to_none=True)
    reply = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord({"num-examples": 8})})
    return Message(content=reply, reply_to=msg)

ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(),
              run_config={})
out = {}
for rnd in (1, 2):
    cfg = {"server-round": rnd, **spec["codec"], "residual-dtype": spec["residual"]}
    md = Metadata(run_id=1, message_id=f"m{rnd}", src_node_id=1, dst_node_id=7, reply_to_message_id="",
                  group_id=str(rnd), created_at=time.time(), ttl=3600.0, message_type="train")
    msg = Message(content=RecordDict({"arrays": ArrayRecord(model.state_dict()), "config": ConfigRecord(cfg)}),
                  metadata=md)
    gc.collect()
    base = status()["VmRSS"]
    reset_peak()
    reply = handler(msg, ctx) if spec["mode"] == "plain" else compression_mod(msg, ctx, handler)
    peak = status()["VmHWM"]
    assert not reply.has_error()
    metrics = dict(reply.content["metrics"])
    del msg, reply
out = {"peak_bytes": peak, "base_bytes": base, "model_bytes": model_bytes,
       "residual_bytes": metrics.get("residual-bytes", 0.0), "upload_bytes": metrics.get("upload-bytes", 0.0)}
print(json.dumps(out))
"""


def child(spec: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(REPO), json.dumps(spec)], check=True, capture_output=True,
                         text=True, timeout=900, cwd=REPO).stdout.strip().splitlines()
    return json.loads(out[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--codecs", nargs="+", default=list(CODECS))
    ap.add_argument("--residuals", nargs="+", default=["fp32", "fp16"])
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per row (medians)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    width = 16 if args.quick else 64
    repeats = 1 if args.quick else args.repeats
    out = output_path("memory_share", args.out, args.quick)
    plain = [child({"mode": "plain", "width": width, "codec": CODECS["stc"], "residual": "fp32"})
             for _ in range(repeats)]
    plain_peak = statistics.median(p["peak_bytes"] for p in plain)
    mb = plain[0]["model_bytes"]
    print(f"ResNet-18 width {width}: model {mb / 2**20:.1f} MiB fp32; round without fedcomp peaks at "
          f"{plain_peak / 2**20:.0f} MiB (RSS before it {plain[0]['base_bytes'] / 2**20:.0f} MiB)")
    print(f"{'codec':<6} {'residual':<8} {'peak MiB':>9} {'fedcomp share MiB':>18} {'share x model':>14} "
          f"{'residual MiB':>13} {'residual x model':>17}")
    rows = []
    for name in args.codecs:
        for res in args.residuals:
            runs = [child({"mode": "mod", "width": width, "codec": CODECS[name], "residual": res})
                    for _ in range(repeats)]
            peak = statistics.median(r["peak_bytes"] for r in runs)
            row = {"codec": name, "residual-dtype": res, "model-bytes": mb, "plain-peak-bytes": plain_peak,
                   "peak-bytes": peak, "share-bytes": peak - plain_peak, "share-x-model": (peak - plain_peak) / mb,
                   "residual-bytes": runs[0]["residual_bytes"], "residual-x-model": runs[0]["residual_bytes"] / mb,
                   "upload-bytes": runs[0]["upload_bytes"], "width": width, "repeats": repeats}
            rows.append(row)
            print(f"{name:<6} {res:<8} {peak / 2**20:>9.0f} {row['share-bytes'] / 2**20:>18.1f} "
                  f"{row['share-x-model']:>14.2f} {row['residual-bytes'] / 2**20:>13.1f} "
                  f"{row['residual-x-model']:>17.2f}",
                  flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"plain": plain, "rows": rows}, indent=1))
    print(f"wrote {shown(out)}")


if __name__ == "__main__":
    main()
