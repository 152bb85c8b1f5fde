"""ServerApp: FedAvg over the adapters, as FlowerTune's server has it (it loads the model and starts
from ``get_peft_model_state_dict``). With fedcomp, one argument (``preset="lora"``): the adapters
travel sign-coded with error feedback both ways, the strategy gives every client a seeded start
instead of the adapters (it recognises peft's initialisation), and lagging clients get small
catch-ups."""

import json
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from peft import get_peft_model_state_dict

from fedcomp.strategies import CompressedStrategy  # fedcomp

from .task import model_from_config

app = ServerApp()


def make_strategy(cfg) -> CompressedStrategy:
    """The strategy (a function so that tests can run it on their own grid)."""
    fedavg = FedAvg(fraction_train=float(cfg["fraction-train"]), fraction_evaluate=0.0,
                    min_train_nodes=1, min_available_nodes=int(cfg["min-nodes"]))
    return CompressedStrategy(fedavg, preset="lora")  # fedcomp: was `return fedavg`


def initial_arrays(cfg) -> ArrayRecord:
    """The initial adapters, as FlowerTune's server takes them from the loaded model."""
    return ArrayRecord(get_peft_model_state_dict(model_from_config(cfg)))


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    arrays = initial_arrays(cfg)
    strategy = make_strategy(cfg)
    result = strategy.start(grid=grid, initial_arrays=arrays, train_config=ConfigRecord({"seed": int(cfg["seed"])}),
                            num_rounds=int(cfg["num-server-rounds"]))
    keys = ("upload-bytes", "download-bytes", "num-replies", "train-loss")
    rounds = {r: {k: m.get(k) for k in keys} for r, m in result.train_metrics_clientapp.items()}
    up = sum(r["upload-bytes"] for r in rounds.values())
    down = sum(r["download-bytes"] for r in rounds.values())
    print(f"lorafinetune: finished {cfg['num-server-rounds']} rounds, {up} bytes up, {down} bytes down")
    if cfg.get("results-file"):
        Path(str(cfg["results-file"])).write_text(json.dumps({"rounds": rounds, "upload": up, "download": down}))
