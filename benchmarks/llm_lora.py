"""LLM benchmark, LoRA part: federated LoRA fine-tuning, FlowerTune-style, with
compressed adapters in both directions, and the FlowerTune general-NLP projection.

1. Base model: the small Llama-architecture Transformer of ``model = "transformer"`` (fedcomp.task.lm),
   pretrained here briefly on Shakespeare's comedies (byte-level next-character loss, AdamW), saved
   with ``save_pretrained`` into ``$FEDCOMP_DATA_DIR/lora-base-<steps>-<seed>`` and loaded back
   through ``base-model`` (the code path a hub id takes on a connected machine).
2. Federation: one client per speaking role of the tragedies (the ``nodes`` roles with the most
   lines), FlowerTune's sampling (``per-round`` of them per round, the same sample in every case),
   LoRA adapters trained with AdamW on each role's train split; eval loss of base + global adapters
   on the roles' held-out windows after every round. Only adapters travel, compressed both ways
   (``downstream`` with the seeded start; lagging clients get catch-ups).
3. Per case: eval-loss gain (base loss - mean of the last 3 rounds' loss) as a fraction of fp32's,
   bytes up and down (measured: payload bytes that travel), the total's ratio to fp32 adapters, and
   bits per adapter parameter per message in each direction.
4. Projection (computed from the measured bits per parameter, not measured on Mistral): the GiB of
   FlowerTune's general-NLP baseline (13.63M adapter parameters, 2 clients x 2 directions x 200
   rounds; FlowerTune reports 40.7 GB for fp32 adapters) per codec, next to NVFlare's 8-bit (25 %
   of fp32) and 4-bit (14 %) message quantization.

Run: ``python benchmarks/llm_lora.py [--rounds 30] [--nodes 8] [--per-round 2] [--cases ...]``;
``--quick`` (3 rounds, 2 cases, a 20-step base) writes a temporary file (``benchmarks/outputs.py``),
never the committed results. Results go under the key ``"lora"`` of ``benchmarks/results/llm.json`` (other keys kept).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import random
import statistics
import sys
import time

import torch
from flwr.app import ConfigRecord, MetricRecord
from flwr.serverapp.strategy import FedAvg
from torch.utils.data import ConcatDataset, TensorDataset

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from outputs import output_path  # noqa: E402 - quick runs never write over the reference

from fedcomp.task import text_data  # noqa: E402
from fedcomp.app.lora_client_app import eval_lm, lora_client_app, lora_model  # noqa: E402
from fedcomp.task.lm import build_transformer, transformer_config  # noqa: E402
from fedcomp.task.lora import LoraSettings, initial_adapters, load_adapters  # noqa: E402
from fedcomp.run.inprocess_grid import InProcessGrid  # noqa: E402
from fedcomp.statedict import to_record, to_state_dict  # noqa: E402
from fedcomp.strategies import CompressedStrategy, Download  # noqa: E402


COMEDIES = ("alls_well_that_ends_well", "as_you_like_it", "comedy_of_errors", "loves_labours_lost",
            "measure_for_measure", "merchant_of_venice", "merry_wives_of_windsor", "midsummer_nights_dream",
            "much_ado_about_nothing", "taming_of_the_shrew", "twelfth_night", "two_gentlemen_of_verona")
TRAGEDIES = ("antony_and_cleopatra", "coriolanus", "hamlet", "julius_caesar", "lear", "macbeth", "othello",
             "romeo_and_juliet", "timon_of_athens", "tragedy_of_titus_andronicus", "troilus_and_cressida")

#: LoRA on every projection of the attention and the MLP (r = 16): 47,104 adapter parameters.
LORA = {"lora-r": 16, "lora-alpha": 32, "lora-targets": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"}
#: upload codec / downstream codec per case (error feedback on both sides wherever the codec is lossy).
CASES = {
    "fp32": {"compressor": "none", "downstream": "none"},
    "int8": {"compressor": "int8", "downstream": "int8"},
    # QSGD at 3 levels is refused under error feedback both ways (it diverges: llm.json's "qsgd 3 levels" row)
    "sign+EF": {"compressor": "sign", "downstream": "sign"},
    "eden 1 bit": {"compressor": "eden", "downstream": "eden"},
    "topk 1%": {"compressor": "topk", "density": 0.01, "downstream": "topk"},
    "stc 1%": {"compressor": "stc", "density": 0.01, "downstream": "stc"},
    "stc 5%": {"compressor": "stc", "density": 0.05, "downstream": "stc"},
    "stc 5% up, sign down": {"compressor": "stc", "density": 0.05, "downstream": "sign"},
    "sign+EF, dense down": {"compressor": "sign", "downstream": "none"},
    # what closes the gap: density, and which direction costs the gain
    "stc 1% up, dense down": {"compressor": "stc", "density": 0.01, "downstream": "none"},
    "stc 5% up, dense down": {"compressor": "stc", "density": 0.05, "downstream": "none"},
    "stc 2%": {"compressor": "stc", "density": 0.02, "downstream": "stc"},
    "stc 10%": {"compressor": "stc", "density": 0.1, "downstream": "stc"},
    "stc 5%, exact catch-ups": {"compressor": "stc", "density": 0.05, "downstream": "stc", "exact-catchup": True},
    # below one bit: sign on a shared random subset
    "randsign 50%": {"compressor": "randsign", "density": 0.5, "downstream": "randsign"},
    "randsign 25%": {"compressor": "randsign", "density": 0.25, "downstream": "randsign"},
    "randsign 50% up, sign down": {"compressor": "randsign", "density": 0.5, "downstream": "sign"},
    "randsign 50% per tensor": {"compressor": "randsign", "density": 0.5, "selection": "tensor",
                                "downstream": "randsign"},
    "randsign 25% up, sign down": {"compressor": "randsign", "density": 0.25, "downstream": "sign"},
    "randsign 50%, exact catch-ups": {"compressor": "randsign", "density": 0.5, "downstream": "randsign",
                                      "exact-catchup": True},
    # FFA-LoRA (Sun et al., ICLR 2024): lora_A frozen at its seeded start, only lora_B trained
    "fp32 FFA-LoRA": {"compressor": "none", "downstream": "none", "freeze-a": True},
    "sign+EF FFA-LoRA": {"compressor": "sign", "downstream": "sign", "freeze-a": True},
    "sign+EF FFA-LoRA, dense down": {"compressor": "sign", "downstream": "none", "freeze-a": True},
    # what the download costs: a denser download, and per-tensor codecs
    "sign up, int8 down": {"compressor": "sign", "downstream": "int8"},
    "sign up, eden down": {"compressor": "sign", "downstream": "eden"},
    "sign+EF, exact catch-ups": {"compressor": "sign", "downstream": "sign", "exact-catchup": True},
    "sign+EF, 8 copies": {"compressor": "sign", "downstream": "sign", "downstream_max_copies": 8},
    # the downstream correction (download/correction.py): updates counted from the global model
    "stc 5%, correction": {"compressor": "stc", "density": 0.05, "downstream": "stc", "downstream_correction": 1.0},
    "sign+EF, correction": {"compressor": "sign", "downstream": "sign", "downstream_correction": 1.0},
    # the two sides of the 100x-both-ways budget alone: each direction compressed, the other exact
    "stc 10% up, dense down": {"compressor": "stc", "density": 0.1, "downstream": "none"},
    "fp32 up, stc 5% down": {"compressor": "none", "downstream": "stc", "downstream_density": 0.05},
    "fp32 up, stc 5% down, correction": {"compressor": "none", "downstream": "stc", "downstream_density": 0.05,
                                         "downstream_correction": 1.0},
    "fp32 up, stc 10% down, correction": {"compressor": "none", "downstream": "stc", "downstream_density": 0.1,
                                          "downstream_correction": 1.0},
    "fp32 up, sign down": {"compressor": "none", "downstream": "sign"},
    "fp32 up, randsign 50% down": {"compressor": "none", "downstream": "randsign", "downstream_density": 0.5},
    "fp32 up, randsign 50% down, correction": {"compressor": "none", "downstream": "randsign",
                                               "downstream_density": 0.5, "downstream_correction": 1.0},
}
#: case keys that are not CompressedStrategy arguments
NOT_CODEC = ("downstream", "exact-catchup", "freeze-a")
#: case keys of the download's settings (as the results record them) -> their `Download` fields
DOWNLOAD_KEYS = {"downstream_density": "density", "downstream_max_copies": "max_copies",
                 "downstream_correction": "correction"}
FLOWERTUNE = {"adapter_params": 13.63e6, "clients_per_round": 2, "directions": 2, "rounds": 200,
              "reported_gb": 40.7}
NVFLARE = {"8-bit (NVFlare)": 0.25, "4-bit (NVFlare)": 0.14}
#: FlowerTune's General NLP leaderboard (https://flower.ai/benchmarks/llm-leaderboard/nlp/, read
#: 2026-12-02): communication cost of the Mistral-7B baseline, of the one Mistral-7B entry and of the
#: lowest-cost entries, as reported there (GB per run; each entry its own base model, rank and rounds).
LEADERBOARD = [("baseline, Mistral-7B-v0.3", 40.7), ("ZJUDAI, Mistral-7B-Instruct-v0.3", 2.0),
               ("T-IoI@UNR, Gemma2-9b-cpt-sahabatai-v1-instruct", 0.7), ("Gachon, Gemma2-9B-instruct", 0.7),
               ("ZJUDAI, Qwen2.5-1.5B-Instruct", 0.7), ("ZJUDAI, Llama-3.2-1B-Instruct (lowest)", 0.5)]


def _windows(parts: list[bytes], limit: int | None = None) -> TensorDataset:
    xs, ys = zip(*(text_data.windows(p) for p in parts if len(p) > text_data.SEQ_LEN + 1))
    x, y = torch.cat(xs), torch.cat(ys)
    return TensorDataset(x[:limit], y[:limit]) if limit else TensorDataset(x, y)


def pretrain_base(steps: int, seed: int, threads: int) -> tuple[pathlib.Path, dict]:
    """Pretrain the small Transformer on the comedies; save_pretrained (cached by steps and seed)."""
    out = text_data.cache_dir() / f"lora-base-{steps}-{seed}"
    info_file = out / "fedcomp-pretrain.json"
    if info_file.exists():
        return out, json.loads(info_file.read_text())
    texts = text_data.read_texts(text_data.texts_dir())
    data = _windows([texts[p].encode("utf-8") for p in COMEDIES if p in texts])
    torch.manual_seed(seed)
    model = build_transformer(transformer_config(), seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    t0, losses = time.perf_counter(), []
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(data), (32,), generator=gen)
        x, y = data.tensors[0][idx], data.tensors[1][idx]
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    info = {"steps": steps, "seed": seed, "comedy_windows": len(data), "seconds": time.perf_counter() - t0,
            "final_train_loss": statistics.fmean(losses[-20:]),
            "parameters": sum(p.numel() for p in model.parameters())}
    info_file.write_text(json.dumps(info))
    return out, info


def tragedy_roles(nodes: int):
    """The ``nodes`` speaking roles of the tragedies with the most lines (LEAF partition)."""
    texts = text_data.read_texts(text_data.texts_dir())
    roles = text_data.partition_roles({p: texts[p] for p in TRAGEDIES if p in texts})
    return sorted(roles, key=lambda r: (-r.num_lines, r.name))[:nodes]


def run_case(name: str, case: dict, base: pathlib.Path, roles, test, args) -> dict:
    """One federation: ``args.rounds`` rounds, ``args.per_round`` of ``len(roles)`` clients each."""
    run_config = {"base-model": str(base), **LORA, "local-steps": args.local_steps, "batch-size": 16,
                  "lr": args.lr, "seed": args.seed}
    settings = LoraSettings.from_mapping(run_config)
    data = [_windows([r.train]) for r in roles]
    app = lora_client_app(lambda ctx: data[int(ctx.node_config["partition-id"])])
    grid = InProcessGrid(app, len(roles), run_config)
    init, seeded = initial_adapters(settings, args.seed)
    n_params = sum(v.numel() for v in init.values())
    codec = {k: v for k, v in case.items() if k not in NOT_CODEC and k not in DOWNLOAD_KEYS}
    catchup = "exact" if case.get("exact-catchup") else "smallest"
    download = Download(case["downstream"], init=seeded, catchup=catchup,
                        **{DOWNLOAD_KEYS[k]: v for k, v in case.items() if k in DOWNLOAD_KEYS})
    strategy = CompressedStrategy(FedAvg(fraction_train=args.per_round / len(roles), min_train_nodes=args.per_round,
                                         min_available_nodes=len(roles), fraction_evaluate=0.0),
                                  downstream=download, **codec)
    model = lora_model(settings)  # the process's one peft model: the ClientApp trains this object too
    frozen = [p for n, p in model.named_parameters() if case.get("freeze-a") and "lora_A" in n]
    for p in frozen:  # FFA-LoRA: train_adapters optimises the parameters that require grad, lora_B only
        p.requires_grad_(False)
    curve = []

    def evaluate(rnd: int, arrays):
        load_adapters(model, to_state_dict(arrays))
        loss, acc = eval_lm(model, test)
        curve.append({"round": rnd, "loss": loss, "accuracy": acc})
        return MetricRecord({"loss": loss, "accuracy": acc})

    random.seed(args.seed)  # Flower samples with random.sample: the same clients in every case
    t0 = time.perf_counter()
    try:
        strategy.start(grid=grid, initial_arrays=to_record(init), num_rounds=args.rounds,
                       train_config=ConfigRecord({"seed": args.seed}), evaluate_fn=evaluate)
    finally:
        for p in frozen:
            p.requires_grad_(True)
    secs = time.perf_counter() - t0
    hist = [strategy.history[r] for r in sorted(strategy.history) if strategy.history[r]]
    up = sum(h["upload-bytes"] for h in hist)
    down = sum(h["download-bytes"] for h in hist)
    msgs = sum(h["num-replies"] for h in hist)
    return {"case": name, **case, "adapter_params": n_params, "rounds": len(hist), "client_messages": msgs,
            "base_loss": curve[0]["loss"], "final_loss": statistics.fmean(c["loss"] for c in curve[-3:]),
            "final_accuracy": statistics.fmean(c["accuracy"] for c in curve[-3:]),
            "upload_bytes": up, "download_bytes": down, "total_bytes": up + down,
            "bits_up": 8 * up / (n_params * msgs), "bits_down": 8 * down / (n_params * msgs),
            "seconds": secs, "loss_curve": [c["loss"] for c in curve],
            "upload_bytes_curve": [h["upload-bytes"] for h in hist],
            "download_bytes_curve": [h["download-bytes"] for h in hist]}


def add_comparisons(rows: list[dict]) -> None:
    """Gain kept (fraction of fp32's eval-loss reduction) and bytes ratio against fp32 adapters."""
    ref = next((r for r in rows if r["case"] == "fp32"), None)
    if ref is None:
        return
    ref_gain = ref["base_loss"] - ref["final_loss"]
    for r in rows:
        r["gain"] = r["base_loss"] - r["final_loss"]
        r["gain_kept"] = r["gain"] / ref_gain if ref_gain > 0 else float("nan")
        r["ratio_total"] = ref["total_bytes"] / r["total_bytes"]
        r["ratio_up"] = ref["upload_bytes"] / r["upload_bytes"]
        r["ratio_down"] = ref["download_bytes"] / r["download_bytes"]
        r["meets_target"] = bool(r["ratio_total"] >= 100 and r["gain_kept"] >= 0.9)


def projection(rows: list[dict]) -> list[dict]:
    """FlowerTune general-NLP GiB per codec from the measured bits per parameter (both directions)."""
    ft = FLOWERTUNE
    scale = ft["adapter_params"] * ft["clients_per_round"] * ft["rounds"] / 8 / 2**30
    out = [{"codec": "fp32 (FlowerTune reports 40.7 GB)", "gib": scale * 32 * 2, "ratio": 1.0}]
    for name, frac in NVFLARE.items():
        out.append({"codec": name, "gib": scale * 32 * 2 * frac, "ratio": 1 / frac})
    for r in rows:
        gib = scale * (r["bits_up"] + r["bits_down"])
        out.append({"codec": f"fedcomp {r['case']} (measured bits)", "gib": gib, "ratio": scale * 64 / gib,
                    "bits_up": r["bits_up"], "bits_down": r["bits_down"]})
    return out


def run_lora(args) -> dict:
    """Pretrain (or reuse) the base, then every case; returns the ``"lora"`` part of llm.json."""
    base, info = pretrain_base(args.pretrain_steps, args.seed, args.threads)
    roles = tragedy_roles(args.nodes)
    test = ConcatDataset([_windows([r.test], limit=args.test_windows // len(roles)) for r in roles])
    rows = []
    for name in args.cases:
        row = run_case(name, CASES[name], base, roles, test, args)
        rows.append(row)
        print(f"{name:24s} loss {row['base_loss']:.4f} -> {row['final_loss']:.4f}  "
              f"up {row['upload_bytes']/1e3:9.1f} kB down {row['download_bytes']/1e3:9.1f} kB  {row['seconds']:.0f} s",
              flush=True)
    add_comparisons(rows)
    return {"base": {"pretrain": info, "plays": list(COMEDIES)}, "lora": LORA,
            "federation": {"clients": len(roles), "per_round": args.per_round, "rounds": args.rounds,
                           "local_steps": args.local_steps, "lr": args.lr, "roles": [r.name for r in roles],
                           "test_windows": len(test)},
            "results": rows, "projection": projection(rows)}


def markdown_lora(part: dict) -> str:
    """The docs' tables (docs/benchmarks/llm.md): codecs against fp32 adapters, and the FlowerTune projection."""
    lines = ["| case (up / down) | eval-loss gain kept | bytes up | bytes down | total vs fp32 | bits/param up, down |",
             "|---|---|---|---|---|---|"]
    for r in part["results"]:
        lines.append(f"| {r['case']} ({r['compressor']} / {r['downstream']}) | {100 * r.get('gain_kept', 0):.0f} % | "
                     f"{r['upload_bytes'] / 1e3:.1f} kB | {r['download_bytes'] / 1e3:.1f} kB | "
                     f"{r.get('ratio_total', 0):.0f}x | {r['bits_up']:.3f}, {r['bits_down']:.3f} |")
    lines += ["", "| FlowerTune general-NLP (13.63M adapters, 2 clients x 2 directions x 200 rounds) | GiB | x fewer |",
              "|---|---|---|"]
    for p in part["projection"]:
        lines.append(f"| {p['codec']} | {p['gib']:.3g} | {p['ratio']:.0f}x |")
    lines += ["", "| FlowerTune General NLP leaderboard entry (reported) | GB per run | x fewer than the baseline |",
              "|---|---|---|"]
    lines += [f"| {name} | {gb:g} | {LEADERBOARD[0][1] / gb:.0f}x |" for name, gb in LEADERBOARD]
    return "\n".join(lines)


def plot_lora(part: dict, path: pathlib.Path) -> None:
    """Eval loss against cumulative MB (both directions) and against the round, per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for r in part["results"]:
        if r["loss_curve"][-1] > 2 * r["base_loss"]:  # diverged (qsgd 3 levels): off the scale
            continue
        cum = [0.0]
        for u, d in zip(r["upload_bytes_curve"], r["download_bytes_curve"]):
            cum.append(cum[-1] + (u + d) / 1e6)
        ax[0].plot(cum, r["loss_curve"], marker=".", label=r["case"])
        ax[1].plot(range(len(r["loss_curve"])), r["loss_curve"], label=r["case"])
    ax[0].set_xscale("symlog", linthresh=0.01)
    ax[0].set_xlabel("cumulative MB, both directions")
    ax[0].set_ylabel("eval loss")
    ax[1].set_xlabel("round")
    ax[1].legend(fontsize=7)
    fig.suptitle(f"LoRA fine-tuning on tragedy roles, {part['federation']['per_round']} of "
                 f"{part['federation']['clients']} clients per round")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--nodes", type=int, default=8, help="clients: tragedy roles with the most lines")
    ap.add_argument("--per-round", type=int, default=2, help="clients sampled per round (FlowerTune: 2 of 20)")
    ap.add_argument("--local-steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--pretrain-steps", type=int, default=400)
    ap.add_argument("--test-windows", type=int, default=256)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--quick", action="store_true", help="3 rounds, 2 cases, 20-step base (smoke test)")
    ap.add_argument("--table-only", action="store_true", help="print the tables from --out; no runs")
    ap.add_argument("--out", default=None, help="default benchmarks/results/llm.json; --quick: a temporary file")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.cases, args.pretrain_steps, args.nodes = 3, ["fp32", "stc 1%"], 20, 4
    out = output_path("llm", args.out, args.quick)
    data = json.loads(out.read_text()) if out.exists() else {}
    if args.table_only:
        print(markdown_lora(data["lora"]))
        return
    logging.getLogger("flwr").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    data["lora"] = run_lora(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {**(json.loads(out.read_text()) if out.exists() else {}), "lora": data["lora"]}  # keep other parts
    out.write_text(json.dumps(data, indent=1))
    plot_lora(data["lora"], out.with_name(out.stem + "-lora.png"))
    print(markdown_lora(data["lora"]))


if __name__ == "__main__":
    main()
