"""ClientApp: set the received adapters, fine-tune them, reply with the adapter state dict."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from peft import get_peft_model_state_dict, set_peft_model_state_dict

from fedcomp.client import compression_mod  # fedcomp

from .task import load_data, model_from_config, test, train

app = ClientApp(mods=[compression_mod])  # fedcomp: was ClientApp()


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    cfg = context.run_config
    pid, nparts = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    model = model_from_config(cfg)
    set_peft_model_state_dict(model, msg.content["arrays"].to_torch_state_dict())
    data = load_data(pid, nparts, int(cfg["seed"]))
    rnd = int(msg.content["config"]["server-round"])
    loss = train(model, data, int(cfg["local-steps"]), float(cfg["lr"]), seed=1000 * rnd + pid)
    metrics = MetricRecord({"train-loss": loss, "num-examples": len(data)})
    content = RecordDict({"arrays": ArrayRecord(get_peft_model_state_dict(model)), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate_fn(msg: Message, context: Context) -> Message:
    cfg = context.run_config
    pid, nparts = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    model = model_from_config(cfg)
    set_peft_model_state_dict(model, msg.content["arrays"].to_torch_state_dict())
    data = load_data(pid, nparts, int(cfg["seed"]), split="test")
    metrics = MetricRecord({"eval-loss": test(model, data), "num-examples": len(data)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
