"""Codec benchmark: payload size, bits/parameter, distance from the information bound, and
encode/decode speed relative to one memory pass (``torch.sum``) over the same tensor.

Run: ``python benchmarks/codecs.py [--sizes 11000000 100000] [--repeats 5]``.
Prints a table and writes ``benchmarks/results/codecs.json``. Both sides of every ratio are
measured in this one process (the machines are shared and noisy); times are medians.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import struct
import time

import torch

import fedcomp.compression as fc
from fedcomp.compression.positions import information_bound_bits
from fedcomp.compression.sparse import k_for
from fedcomp.compression.wire import parse_header

CASES = [
    ("none", {}), ("fp16", {}), ("bf16", {}), ("int8", {"block_size": 256}), ("qsgd", {"levels": 15}),
    ("sign", {}), ("topk", {"density": 0.01}), ("topk", {"density": 0.001}),
    ("stc", {"density": 0.01}), ("stc", {"density": 0.0025}), ("stc", {"density": 0.001}),
    ("randomk", {"density": 0.01}),
]


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def position_bits(payload: bytes, name: str, n: int, density: float) -> tuple[int, float]:
    """Bits spent on positions and the information bound log2 C(n, k)."""
    h = parse_header(payload)
    k, unary_bits, b = struct.unpack_from("<QQB", h.params)
    bits = 8 * (math.ceil(unary_bits / 8) + math.ceil(k * b / 8))
    return bits, information_bound_bits(k_for(density, n), n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[11_000_000, 100_000])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "codecs.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for n in args.sizes:
        x = torch.randn(n)
        sum_ms = median_ms(lambda: torch.sum(x), args.repeats * 4)
        for name, params in CASES:
            c = fc.get_compressor(name, **params)
            payload = c.compress(x)
            enc = median_ms(lambda: c.compress(x), args.repeats)
            dec = median_ms(lambda: fc.decompress(payload), args.repeats)
            row = {
                "n": n, "codec": name, **params, "bytes": len(payload),
                "bits_per_param": 8 * len(payload) / n,
                "encode_ms": enc, "decode_ms": dec, "sum_ms": sum_ms,
                "speed_vs_sum": sum_ms / (enc + dec),
                "compression_error": fc.compression_error(x, fc.decompress(payload)),
            }
            if name in ("stc", "topk"):
                bits, bound = position_bits(payload, name, n, params["density"])
                row["position_bits_over_bound"] = bits / bound
            rows.append(row)
    hdr = f"{'n':>9} {'codec':<8} {'param':<14} {'bytes':>10} {'bit/param':>9} {'pos/bound':>9} " \
          f"{'enc ms':>8} {'dec ms':>8} {'sum ms':>7} {'speed/sum':>9} {'rel.err':>7}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        param = ",".join(f"{k}={r[k]}" for k in ("density", "levels", "block_size") if k in r)
        pb = f"{r['position_bits_over_bound']:.4f}" if "position_bits_over_bound" in r else ""
        print(f"{r['n']:>9} {r['codec']:<8} {param:<14} {r['bytes']:>10} {r['bits_per_param']:>9.4f} {pb:>9} "
              f"{r['encode_ms']:>8.2f} {r['decode_ms']:>8.2f} {r['sum_ms']:>7.2f} {r['speed_vs_sum']:>9.3f} "
              f"{r['compression_error']:>7.3f}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"torch_threads": torch.get_num_threads(), "rows": rows}, indent=1))
    print(f"wrote {out.resolve()}")


if __name__ == "__main__":
    main()
