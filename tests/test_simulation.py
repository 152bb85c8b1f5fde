"""The in-process grid (fedcomp.run.inprocess_grid.InProcessGrid) gives each message its own records."""


def test_in_process_grid_gives_each_message_its_own_records():
    # A handler that edits its incoming record must change nothing another client
    # (or the server) sees; before, clients started from models summing to [0, 10, 20, 30].
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from fedcomp.run.inprocess_grid import InProcessGrid

    app = ClientApp()
    seen = []

    @app.train()
    def train(msg, ctx):
        arrays, cfg = msg.content["arrays"], msg.content["config"]
        w = arrays["w"].numpy()
        seen.append((float(w.sum()), cfg.get("edited")))
        arrays["w"] = Array(w + 10.0)  # the hostile/buggy part: edit the incoming record in place
        cfg["edited"] = True
        msg.content["extra"] = ConfigRecord({"x": 1})
        return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

    grid = InProcessGrid(app, 4, {})
    shared = RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(3, np.float32))}),
                         "config": ConfigRecord({"server-round": 1})})
    msgs = [grid.create_message(shared, "train", nid, "1") for nid in grid.get_node_ids()]
    replies = list(grid.send_and_receive(msgs))
    assert seen == [(0.0, None)] * 4
    assert float(shared["arrays"]["w"].numpy().sum()) == 0.0 and "edited" not in shared["config"]
    assert set(shared.keys()) == {"arrays", "config"}
    assert [float(r.content["arrays"]["w"].numpy().sum()) for r in replies] == [30.0] * 4
    assert all(r.metadata.reply_to_message_id == m.metadata.message_id for r, m in zip(replies, msgs))
