"""Codec benchmark: payload size, bits/parameter, distance from the information bound, and
encode/decode speed relative to one memory pass (``torch.sum``) over the same tensor; then the
relative L2 error of each codec on real client updates of the default federation.

Run: ``python benchmarks/codecs.py [--sizes 11000000 100000] [--repeats 5] [--real-rounds 1 10]``.
Prints two tables and writes ``benchmarks/results/codecs.json``. ``--throughput [--quick]`` runs the
throughput mode instead (:func:`throughput`): each codec's encode as a ratio to one read
pass and its decode as a ratio to one fresh copy of the same tensor, written to
``benchmarks/results/codecs_throughput.json`` (``--quick``: a smaller tensor, fewer repeats, written
to the temporary folder, never over the reference). Both sides of every ratio are
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

import numpy as np
import torch

from outputs import output_path, shown  # benchmarks/outputs.py: paths printed relative to the repository

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


#: Codecs of the throughput mode, with their speed targets: encode <= ENC x a read pass
#: plus the payload's share of a fresh copy, decode <= DEC x a fresh copy.
THROUGHPUT_CASES = [
    ("none", {}), ("fp16", {}), ("bf16", {}), ("sign", {}), ("int8", {"block_size": 256}),
    ("qsgd", {"levels": 15}), ("eden", {}), ("stc", {"density": 0.01}), ("stc", {"density": 0.0025}),
    ("topk", {"density": 0.01}), ("randomk", {"density": 0.01}),
]
SLOW_TARGETS = {"qsgd": (10.0, 3.0), "eden": (10.0, 3.0)}
TARGETS = (5.0, 1.5)
#: The part of an encode that byte-identical payloads pin (a faster encode must not change a byte): int8's and QSGD's
#: stochastic rounding reads torch's sequential CPU generator once per entry (``torch.rand`` into a
#: reused buffer); sign's scale is torch's float mean of |x|, which needs |x| written out
#: (``torch.abs`` into a reused buffer, then ``mean``). Measured in the same run as the codecs.
FLOORS = {"int8": "draws", "qsgd": "draws", "sign": "abs_mean"}


def throughput(n: int, repeats: int) -> dict:
    """Encode/decode medians of every :data:`THROUGHPUT_CASES` codec on one float32 N(0, 1) tensor
    of ``n`` entries, with one read pass (``torch.sum``) and one fresh copy (``clone``) of that
    tensor measured in the same process (medians of ``4 * repeats``).

    Returns
    -------
    dict
        ``{"n", "repeats", "torch_threads", "sum_ms", "clone_ms", "floors_ms", "rows"}``; each row: codec, its
        parameters, ``bytes``, ``encode_ms``, ``decode_ms`` (fresh tensor), ``decode_out_ms``
        (``decompress(out=...)`` into one reused numpy-allocated buffer, where available), ``encode_vs_sum``,
        ``decode_vs_clone``, ``encode_target`` (the encode bound in read passes: ENC + the
        payload's share of a copy over a read pass) and ``decode_target``; int8, qsgd and sign also
        ``floor`` and ``floor_vs_sum``: the part of their encode that identical payload bytes pin
        (:data:`FLOORS`), in read passes.
    """
    torch.manual_seed(0)
    x = torch.randn(n)
    sum_ms = median_ms(lambda: torch.sum(x), 4 * repeats)
    clone_ms = median_ms(lambda: x.clone(), 4 * repeats)
    out_buf = torch.from_numpy(np.empty(n, dtype=np.float32))  # as RunningSum allocates its buffer
    gen, scratch = torch.Generator().manual_seed(0), torch.from_numpy(np.empty(n, dtype=np.float32))
    floors = {"draws": median_ms(lambda: torch.rand(n, generator=gen, out=scratch), repeats),
              "abs_mean": median_ms(lambda: torch.abs(x, out=scratch).mean(), repeats)}
    rows = []
    for name, params in THROUGHPUT_CASES:
        seeded = {"seed": 0} if fc.CODECS[name].seeded else {}
        c = fc.get_compressor(name, **params, **seeded)
        payload = c.compress(x)
        enc = median_ms(lambda c=c: c.compress(x), repeats)
        dec = median_ms(lambda p=payload: fc.decompress(p), repeats)
        try:
            dec_out = median_ms(lambda p=payload: fc.decompress(p, out=out_buf), repeats)
        except TypeError:  # a decompress without out=
            dec_out = None
        enc_x, dec_x = SLOW_TARGETS.get(name, TARGETS)
        share = clone_ms * len(payload) / (4 * n)
        rows.append({"codec": name, **params, "bytes": len(payload), "encode_ms": enc, "decode_ms": dec,
                     "decode_out_ms": dec_out, "encode_vs_sum": enc / sum_ms, "decode_vs_clone": dec / clone_ms,
                     "encode_target": (enc_x * sum_ms + share) / sum_ms, "decode_target": dec_x})
        if name in FLOORS:
            rows[-1]["floor"] = FLOORS[name]
            rows[-1]["floor_vs_sum"] = floors[FLOORS[name]] / sum_ms
    return {"n": n, "repeats": repeats, "torch_threads": torch.get_num_threads(), "sum_ms": sum_ms,
            "clone_ms": clone_ms, "floors_ms": floors, "rows": rows}


def print_throughput(res: dict) -> None:
    """The throughput table: medians in ms and the ratios against the read pass and the copy."""
    print(f"n = {res['n']}, medians of {res['repeats']}; read pass (torch.sum) {res['sum_ms']:.2f} ms, "
          f"fresh copy (clone) {res['clone_ms']:.2f} ms, {res['torch_threads']} torch threads")
    hdr = f"{'codec':<8} {'param':<16} {'enc ms':>8} {'enc/sum':>8} {'target':>7} {'floor':>6} {'dec ms':>8} " \
          f"{'dec/clone':>9} {'target':>6} {'out= ms':>8}"
    print(hdr)
    print("-" * len(hdr))
    for r in res["rows"]:
        out = f"{r['decode_out_ms']:>8.2f}" if r["decode_out_ms"] is not None else f"{'':>8}"
        floor = f"{r['floor_vs_sum']:>6.1f}" if "floor_vs_sum" in r else f"{'':>6}"
        print(f"{r['codec']:<8} {_param(r):<16} {r['encode_ms']:>8.2f} {r['encode_vs_sum']:>8.1f} "
              f"{r['encode_target']:>7.1f} {floor} {r['decode_ms']:>8.2f} {r['decode_vs_clone']:>9.2f} "
              f"{r['decode_target']:>6.1f} {out}")
    print("floor: in read passes, what identical payload bytes pin (int8, qsgd: torch.rand of n draws; "
          "sign: torch.abs into a buffer, then mean)")


def _param(r: dict) -> str:
    return ",".join(f"{k}={r[k]}" for k in PARAM_KEYS if k in r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[11_000_000, 100_000])
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed runs per median (default 5; --throughput 7, --quick 3)")
    ap.add_argument("--real-rounds", type=int, nargs="*", default=[1, 10],
                    help="FedAvg rounds whose client updates are compressed (none: skip)")
    ap.add_argument("--out", default=None, help="JSON file (default: benchmarks/results/codecs.json, or "
                    "codecs_throughput.json with --throughput; a temporary file with --quick)")
    ap.add_argument("--throughput", action="store_true",
                    help="encode vs one read pass and decode vs one fresh copy, instead of the tables")
    ap.add_argument("--n", type=int, default=None,
                    help="entries of the --throughput tensor (default 11.2M; 1M quick)")
    ap.add_argument("--quick", action="store_true",
                    help="--throughput on 1M entries, 3 repeats; never over a reference")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.throughput or args.quick:
        n = args.n or (1_000_000 if args.quick else 11_200_000)
        repeats = args.repeats or (3 if args.quick else 7)
        res = throughput(n, repeats)
        print_throughput(res)
        out = output_path("codecs_throughput", args.out, args.quick)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1))
        print(f"wrote {shown(out)}")
        return
    args.out = args.out or str(pathlib.Path(__file__).parent / "results" / "codecs.json")
    args.repeats = args.repeats or 5
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
        kurtosis = ", ".join(f"round {r}: {k:.1f}"
                             for r, k in sorted({(x["round"], x["update_excess_kurtosis"]) for x in real}))
        print(f"\nreal client updates (default federation, mean over 10 clients; excess kurtosis of the "
              f"updates: {kurtosis})")
        hdr = f"{'round':>5} {'codec':<8} {'param':<26} {'bit/param':>9} {'rel.err':>7}"
        print(hdr)
        print("-" * len(hdr))
        for r in real:
            print(f"{r['round']:>5} {r['codec']:<8} {_param(r):<26} {r['bits_per_param']:>9.4f} "
                  f"{r['rel_l2_error']:>7.3f}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"torch_threads": torch.get_num_threads(), "rows": rows, "real_updates": real}, indent=1))
    print(f"wrote {shown(out)}")


if __name__ == "__main__":
    main()
