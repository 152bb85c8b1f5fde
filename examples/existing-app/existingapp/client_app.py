"""ClientApp of the example: train and evaluate handlers, as in any Flower Message-API app."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedcomp.client import compression_mod  # fedcomp

from .task import Net, load_data, test, train

app = ClientApp(mods=[compression_mod])  # fedcomp: was ClientApp()


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    """Train the received model on the local partition and reply with the full weights."""
    pid, nparts = context.node_config["partition-id"], context.node_config["num-partitions"]
    trainset, _ = load_data(pid, nparts)
    net = Net()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    lr = float(msg.content["config"]["lr"])
    epochs = int(context.run_config["local-epochs"])
    loss = train(net, trainset, epochs, lr, seed=pid)
    metrics = MetricRecord({"train-loss": loss, "num-examples": len(trainset[1])})
    content = RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate_fn(msg: Message, context: Context) -> Message:
    """Evaluate the received model on the local test split."""
    pid, nparts = context.node_config["partition-id"], context.node_config["num-partitions"]
    _, testset = load_data(pid, nparts)
    net = Net()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    loss, acc = test(net, testset)
    metrics = MetricRecord({"eval-loss": loss, "eval-acc": acc, "num-examples": len(testset[1])})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
