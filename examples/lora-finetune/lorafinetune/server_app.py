"""ServerApp: FedAvg over the adapters. With fedcomp the server starts from LoRA's seeded initial
adapters (built from the base model's config alone: it never loads or sends base weights), and the
adapters travel compressed both ways, lagging clients getting small catch-ups."""

import json
from pathlib import Path

from flwr.app import ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedcomp.task.lora import LoraSettings, initial_adapters  # fedcomp
from fedcomp.statedict import to_record  # fedcomp
from fedcomp.strategies import CompressedStrategy  # fedcomp

app = ServerApp()


def make_strategy(cfg, init=None) -> CompressedStrategy:
    """The strategy (a function so that tests can run it on their own grid)."""
    fedavg = FedAvg(fraction_train=float(cfg["fraction-train"]), fraction_evaluate=0.0,
                    min_train_nodes=1, min_available_nodes=int(cfg["min-nodes"]))
    return CompressedStrategy(fedavg, compressor="stc", density=0.05, downstream="stc", downstream_init=init)  # fedcomp


def initial_arrays(cfg):
    """Initial adapters and their seeded description (FlowerTune: get_peft_model_state_dict of a loaded model)."""
    adapters, init = initial_adapters(LoraSettings.from_mapping(cfg), seed=int(cfg["seed"]))  # fedcomp
    return to_record(adapters), init  # fedcomp


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    arrays, init = initial_arrays(cfg)
    strategy = make_strategy(cfg, init)
    result = strategy.start(grid=grid, initial_arrays=arrays, train_config=ConfigRecord({"seed": int(cfg["seed"])}),
                            num_rounds=int(cfg["num-server-rounds"]))
    keys = ("upload-bytes", "download-bytes", "num-replies", "train-loss")
    rounds = {r: {k: m.get(k) for k in keys} for r, m in result.train_metrics_clientapp.items()}
    up = sum(r["upload-bytes"] for r in rounds.values())
    down = sum(r["download-bytes"] for r in rounds.values())
    print(f"lorafinetune: finished {cfg['num-server-rounds']} rounds, {up} bytes up, {down} bytes down")
    if cfg.get("results-file"):
        Path(str(cfg["results-file"])).write_text(json.dumps({"rounds": rounds, "upload": up, "download": down}))
