"""Codec benchmark: payload size, bits/parameter, distance from the information bound, and
encode/decode speed relative to one memory pass (``torch.sum``) over the same tensor; then the
relative L2 error of each codec on real client updates of the default federation.

Run: ``python benchmarks/codecs.py [--sizes 11000000 100000] [--repeats 5] [--real-rounds 1 10]``.
Prints two tables and writes ``benchmarks/results/codecs.json``. Both sides of every ratio are
measured in this one process (the machines are shared and noisy); times are medians. The
Gaussian rows are i.i.d. N(0, 1) vectors (``powersgd`` sees them as a 1000-row matrix, where
low rank has nothing to find); the real-update rows train the default digits CNN with plain
FedAvg (10 clients, Dirichlet 0.5, local SGD with momentum 0.9, fp32) and compress every client's
update tensor by tensor, as ``compression_mod`` does for these codecs.
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

from outputs import shown  # benchmarks/outputs.py: paths printed relative to the repository

import fedcomp.compression as fc
from fedcomp.compression.positions import information_bound_bits
from fedcomp.compression.sparse import k_for
from fedcomp.compression.wire import parse_header

CASES = [
    ("none", {}), ("fp16", {}), ("bf16", {}), ("int8", {"block_size": 256}), ("qsgd", {"levels": 15}),
    ("sign", {}), ("topk", {"density": 0.01}), ("topk", {"density": 0.001}),
    ("stc", {"density": 0.01}), ("stc", {"density": 0.0025}), ("stc", {"density": 0.001}),
    ("randomk", {"density": 0.01}),
    ("qsgd", {"levels": 7}), ("qsgd", {"levels": 7, "spacing": "exponential"}),
    ("eden", {}), ("eden", {"unbiased": True}), ("powersgd", {"rank": 4}),
]
#: Codecs compared on real client updates (tensor by tensor, as the mod runs them).
REAL_CASES = [
    ("sign", {}), ("eden", {}), ("eden", {"unbiased": True}), ("qsgd", {"levels": 7}),
    ("qsgd", {"levels": 7, "spacing": "exponential"}), ("powersgd", {"rank": 1}), ("powersgd", {"rank": 4}),
    ("int8", {}),
]
PARAM_KEYS = ("density", "levels", "block_size", "spacing", "rank", "unbiased")


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


def real_updates(rounds: list[int], num_clients: int = 10, seed: int = 42) -> dict[int, list[dict[str, torch.Tensor]]]:
    """Client updates (trained - global, per float tensor) of the default federation in ``rounds``."""
    from fedcomp.task.training import TrainConfig, train
    from fedcomp.task.data import DataConfig, load_partition
    from fedcomp.task.models import build_model

    torch.manual_seed(seed)
    model = build_model("cnn")
    cfg = DataConfig(seed=seed)
    parts = [load_partition(cfg, i, num_clients) for i in range(num_clients)]
    out: dict[int, list[dict[str, torch.Tensor]]] = {}
    for rnd in range(1, max(rounds) + 1):
        glob = {k: v.detach().clone() for k, v in model.state_dict().items()}
        ups, sizes = [], []
        for i, data in enumerate(parts):
            model.load_state_dict(glob)
            _, n = train(model, data, TrainConfig(), torch.device("cpu"), seed=seed + 1000 * rnd + i)
            ups.append({k: v.detach() - glob[k] for k, v in model.state_dict().items()})
            sizes.append(n)
        if rnd in rounds:
            out[rnd] = ups
        total = sum(sizes)
        model.load_state_dict({k: glob[k] + sum(u[k] * (n / total) for u, n in zip(ups, sizes)) for k in glob})
    return out


def real_rows(rounds: list[int]) -> list[dict]:
    """Relative L2 error over the whole update (sum of per-tensor squared errors) and bits/param,
    mean over the clients, per codec and round; plus the update's excess kurtosis."""
    rows = []
    for rnd, ups in real_updates(rounds).items():
        flat = torch.cat([torch.cat([t.reshape(-1) for t in u.values()]) for u in ups]).double()
        z = (flat - flat.mean()) / flat.std()
        kurt = float((z**4).mean() - 3)
        for name, params in REAL_CASES:
            errs, bits = [], []
            for u in ups:
                sq_err = sq = nbytes = 0.0
                for k, t in u.items():
                    c = fc.get_compressor(name, **params, **({"seed": 0} if fc.CODECS[name].seeded else {}))
                    p = c.compress(t)
                    sq_err += float(((t.double() - fc.decompress(p).double()) ** 2).sum())
                    sq += float((t.double() ** 2).sum())
                    nbytes += len(p)
                errs.append((sq_err / sq) ** 0.5)
                bits.append(8 * nbytes / sum(t.numel() for t in u.values()))
            rows.append({"round": rnd, "codec": name, **params, "rel_l2_error": statistics.mean(errs),
                         "bits_per_param": statistics.mean(bits), "update_excess_kurtosis": kurt})
    return rows


def _param(r: dict) -> str:
    return ",".join(f"{k}={r[k]}" for k in PARAM_KEYS if k in r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[11_000_000, 100_000])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--real-rounds", type=int, nargs="*", default=[1, 10],
                    help="FedAvg rounds whose client updates are compressed (none: skip)")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "codecs.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for n in args.sizes:
        x = torch.randn(n)
        sum_ms = median_ms(lambda: torch.sum(x), args.repeats * 4)
        for name, params in CASES:
            c = fc.get_compressor(name, **params)
            xin = x.view(1000, -1) if fc.CODECS[name].per_tensor_only else x
            payload = c.compress(xin)
            enc = median_ms(lambda: c.compress(xin), args.repeats)
            dec = median_ms(lambda: fc.decompress(payload), args.repeats)
            row = {
                "n": n, "codec": name, **params, "bytes": len(payload),
                "bits_per_param": 8 * len(payload) / n,
                "encode_ms": enc, "decode_ms": dec, "sum_ms": sum_ms,
                "speed_vs_sum": sum_ms / (enc + dec),
                "compression_error": fc.compression_error(xin, fc.decompress(payload)),
            }
            if fc.CODECS[name].sparse and not fc.CODECS[name].seeded:  # Rice-coded positions travel
                bits, bound = position_bits(payload, name, n, params["density"])
                row["position_bits_over_bound"] = bits / bound
            rows.append(row)
    hdr = f"{'n':>9} {'codec':<8} {'param':<26} {'bytes':>10} {'bit/param':>9} {'pos/bound':>9} " \
          f"{'enc ms':>8} {'dec ms':>8} {'sum ms':>7} {'speed/sum':>9} {'rel.err':>7}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        pb = f"{r['position_bits_over_bound']:.4f}" if "position_bits_over_bound" in r else ""
        print(f"{r['n']:>9} {r['codec']:<8} {_param(r):<26} {r['bytes']:>10} {r['bits_per_param']:>9.4f} {pb:>9} "
              f"{r['encode_ms']:>8.2f} {r['decode_ms']:>8.2f} {r['sum_ms']:>7.2f} {r['speed_vs_sum']:>9.3f} "
              f"{r['compression_error']:>7.3f}")
    real = real_rows(args.real_rounds) if args.real_rounds else []
    if real:
        print(f"\nreal client updates (default federation, mean over 10 clients; excess kurtosis of the "
              f"updates: {', '.join(f'round {r}: {k:.1f}' for r, k in sorted({(x['round'], x['update_excess_kurtosis']) for x in real}))})")
        hdr = f"{'round':>5} {'codec':<8} {'param':<26} {'bit/param':>9} {'rel.err':>7}"
        print(hdr)
        print("-" * len(hdr))
        for r in real:
            print(f"{r['round']:>5} {r['codec']:<8} {_param(r):<26} {r['bits_per_param']:>9.4f} {r['rel_l2_error']:>7.3f}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"torch_threads": torch.get_num_threads(), "rows": rows, "real_updates": real}, indent=1))
    print(f"wrote {shown(out)}")


if __name__ == "__main__":
    main()
