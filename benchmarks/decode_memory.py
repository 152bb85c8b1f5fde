"""Peak memory of decoding one payload, per codec and density, as a multiple of the decoded
float32 output (tracemalloc: every decoder allocates numpy arrays only, which tracemalloc sees).

Run: ``python benchmarks/decode_memory.py [--n 1000000]``; prints a table and writes
``benchmarks/results/decode_memory.json``. The bound the tests hold (tests/compression/test_decompression_bombs.py)
is 4x the output.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time
import tracemalloc

import torch

from outputs import shown  # benchmarks/outputs.py: paths printed relative to the repository

import fedcomp.compression as fc

CASES = [("none", {}), ("fp16", {}), ("bf16", {}), ("sign", {}), ("int8", {}), ("qsgd", {}),
         ("qsgd", {"levels": 2**16 - 1})] + [
    (name, {"density": d}) for d in (0.001, 0.01, 0.1, 0.3, 0.5, 1.0) for name in ("topk", "stc", "randomk")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10**6)
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "decode_memory.json"))
    args = ap.parse_args()
    x = torch.randn(args.n, generator=torch.Generator().manual_seed(0))
    rows = []
    print(f"{'codec':<8} {'params':<24} {'payload MB':>10} {'peak / output':>13} {'decode ms':>9}")
    tracemalloc.start()
    for name, kw in CASES:
        payload = fc.get_compressor(name, **kw).compress(x)
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        t0 = time.perf_counter()
        out = fc.decompress(payload)
        ms = (time.perf_counter() - t0) * 1e3
        ratio = (tracemalloc.get_traced_memory()[1] - base) / (4 * args.n)
        del out
        rows.append({"codec": name, "params": kw, "n": args.n, "payload_bytes": len(payload),
                     "peak_over_output": ratio, "decode_ms": ms})
        print(f"{name:<8} {json.dumps(kw):<24} {len(payload) / 2**20:>10.2f} {ratio:>12.2f}x {ms:>9.1f}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows}, indent=1))
    print(f"wrote {shown(out)}")


if __name__ == "__main__":
    main()
