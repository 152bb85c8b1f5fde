"""Long-running fuzz of ``decompress``: truncations, bit flips, byte overwrites, splices and random
headers over payloads of every codec; every case must either decode to a finite float32 tensor of
the header's shape or raise ``PayloadError`` (the documented rejection). Anything else is a failure.

Run: ``python benchmarks/fuzz.py [--cases 100000] [--seed 0]``; prints a summary and writes
``benchmarks/results/fuzz.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import time
import traceback

import numpy as np
import torch

from outputs import shown  # benchmarks/outputs.py: paths printed relative to the repository

import fedcomp.compression as fc
from fedcomp.compression.wire import pack_header


def seeds(rng: np.random.Generator) -> list[bytes]:
    out = []
    for name in fc.available_compressors():
        for shape in [(0,), (1,), (7,), (3, 5), (257,), (40, 50)]:
            x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
            params = {"seed": 0} if fc.CODECS[name].seeded else {}
            if fc.CODECS[name].sparse:
                params["density"] = float(rng.choice([0.01, 0.1, 0.5, 1.0]))
            out.append(fc.get_compressor(name, **params).compress(x))
    return out


def mutate(p: bytes, rng: np.random.Generator) -> bytes:
    b = bytearray(p)
    op = rng.integers(0, 6)
    if op == 0 and b:  # truncate
        return bytes(b[: rng.integers(0, len(b))])
    if op == 1 and b:  # bit flips
        for _ in range(rng.integers(1, 5)):
            i = rng.integers(0, len(b))
            b[i] ^= 1 << int(rng.integers(0, 8))
        return bytes(b)
    if op == 2 and b:  # overwrite bytes (often in the header)
        for _ in range(rng.integers(1, 4)):
            i = rng.integers(0, min(len(b), 64) if rng.random() < 0.7 else len(b))
            b[i] = rng.integers(0, 256)
        return bytes(b)
    if op == 3:  # append garbage
        return bytes(b) + rng.bytes(int(rng.integers(1, 64)))
    if op == 4:  # random header + random body
        shape = tuple(int(d) for d in rng.integers(0, 300, size=rng.integers(0, 4)))
        dtype = [torch.float32, torch.float16, torch.bfloat16, torch.float64][rng.integers(0, 4)]
        return pack_header(int(rng.integers(0, 10)), dtype, shape, rng.bytes(int(rng.integers(0, 40)))) + \
            rng.bytes(int(rng.integers(0, 400)))
    return rng.bytes(int(rng.integers(0, 200)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "fuzz.json"))
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    pool = seeds(rng)
    outcome: collections.Counter = collections.Counter()
    failures = []
    t0 = time.perf_counter()
    for _ in range(args.cases):
        data = mutate(pool[rng.integers(0, len(pool))], rng)
        try:
            out = fc.decompress(data, max_numel=1 << 20)
            ok = out.dtype == torch.float32 and bool(torch.isfinite(out).all())
            outcome["decoded" if ok else "bad-output"] += 1
            if not ok:
                failures.append({"payload": data.hex()[:400], "error": "non-finite or non-float32 output"})
        except fc.PayloadError:
            outcome["payload-error"] += 1
        except Exception as exc:  # noqa: BLE001 - anything else is what we are hunting
            outcome["other-exception"] += 1
            failures.append({"payload": data.hex()[:400], "error": "".join(traceback.format_exception_only(exc))})
    secs = time.perf_counter() - t0
    report = {"cases": args.cases, "seed": args.seed, "seconds": secs, "outcomes": dict(outcome),
              "failures": len(failures), "first_failures": failures[:10]}
    print(f"{args.cases} cases in {secs:.1f} s: {dict(outcome)}; failures (not PayloadError, not a valid decode): "
          f"{len(failures)}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {shown(out)}")


if __name__ == "__main__":
    main()
