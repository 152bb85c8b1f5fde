"""The new codecs and their client state through compression_mod and CompressedStrategy:
PowerSGD's warm-start Q and DGC's momentum persist in context.state and client-state-dir."""

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import FedAvg

import fedcomp.compression as fc
from fedcomp.client import compression_mod
from fedcomp.protocol.messages import MODEL_KEY, RESIDUAL_STATE_KEY
from fedcomp.run.inprocess_grid import InProcessGrid
from fedcomp.strategies import CompressedStrategy
from tests.messages import make_ctx, reply_with, train_msg


def model_weights(seed):
    g = torch.Generator().manual_seed(seed)
    return {"fc.weight": torch.randn(64, 32, generator=g).numpy(), "fc.bias": torch.randn(64, generator=g).numpy()}


def mod_round(g, t, cfg, ctx, rnd):
    msg = train_msg(g, {**cfg, "server-round": rnd})
    return compression_mod(msg, ctx, lambda m, c: reply_with(m, t))


def payloads(reply):
    return {k: a.data for k, a in reply.content["arrays"].items()}


POWERSGD = {"compressor": "powersgd", "rank": 2}


def test_powersgd_warm_start_q_is_kept_and_used():
    g, t1, t2 = model_weights(0), model_weights(1), model_weights(2)
    ctx = make_ctx()
    r1 = mod_round(g, t1, POWERSGD, ctx, 1)
    state = {k: a.numpy() for k, a in ctx.state[RESIDUAL_STATE_KEY].items()}
    assert set(state) == {"fc.weight", "fc.weight#powersgd/q", "fc.bias"}
    assert state["fc.weight#powersgd/q"].shape == (32, 2)
    assert fc.codec_name(payloads(r1)["fc.weight"]) == "powersgd" and fc.codec_name(payloads(r1)["fc.bias"]) == "none"
    # round 2 continues from the saved state: the same as an ErrorFeedback restored from it
    ef = fc.ErrorFeedback(fc.get_compressor("powersgd", rank=2, seed=123))
    ef.set_state(fc.unflatten_states(state)["fc.weight"])
    expected = ef.compress(torch.from_numpy(t2["fc.weight"] - g["fc.weight"]))
    r2 = mod_round(g, t2, POWERSGD, ctx, 2)
    assert payloads(r2)["fc.weight"] == expected
    m = r2.content["metrics"]
    assert m["residual-bytes"] == 4.0 * (64 * 32 + 32 * 2 + 64)


def test_state_survives_a_restart_through_client_state_dir(tmp_path):
    g, t1, t2 = model_weights(0), model_weights(1), model_weights(2)
    node = {"state-dir": str(tmp_path)}
    cfg = {"compressor": "stc", "density": 0.05, "momentum-correction": 0.9}
    ctx = make_ctx(node_config=node)
    mod_round(g, t1, cfg, ctx, 1)
    saved = {k: a.numpy() for k, a in ctx.state[RESIDUAL_STATE_KEY].items()}
    assert set(saved) == {MODEL_KEY, f"{MODEL_KEY}#momentum"}
    restarted = mod_round(g, t2, cfg, make_ctx(node_config=node), 2)  # a fresh process, same state dir
    keep = mod_round(g, t2, cfg, ctx, 2)  # the node kept running
    assert payloads(restarted) == payloads(keep)
    with np.load(tmp_path / "residual-0.npz") as z:
        assert f"r/{MODEL_KEY}#momentum" in z.files


def test_momentum_correction_changes_what_is_sent():
    g, t1, t2 = model_weights(0), model_weights(1), model_weights(2)
    sent = {}
    for beta in (0.0, 0.9):
        ctx = make_ctx()
        cfg = {"compressor": "topk", "density": 0.05, "momentum-correction": beta}
        mod_round(g, t1, cfg, ctx, 1)
        sent[beta] = payloads(mod_round(g, t2, cfg, ctx, 2))[MODEL_KEY]
    assert sent[0.0] != sent[0.9]


@pytest.mark.parametrize("codec", [
    {"compressor": "powersgd", "rank": 2, "layer-codecs": "conv2.*=eden, fc2.*=qsgd", "spacing": "exponential"},
    {"compressor": "stc", "density": 0.05, "momentum-correction": 0.9},
])
def test_federation_in_process(codec):
    """Real ClientApp + mod + CompressedStrategy(FedAvg) on the default CNN, 2 clients, 2 rounds."""
    from fedcomp.app.client_app import app as client_app
    from fedcomp.task.models import build_model

    common = {"fraction_evaluate": 0.0, "min_available_nodes": 2, "min_train_nodes": 2}
    grid = InProcessGrid(client_app, 2, {"num-server-rounds": 2})
    s = CompressedStrategy(FedAvg(**common), **{k.replace("-", "_"): v for k, v in codec.items()})
    start = ArrayRecord(build_model().state_dict())
    init = {k: v.numpy().copy() for k, v in start.items()}
    res = s.start(grid=grid, initial_arrays=start, num_rounds=2, train_config=ConfigRecord({"seed": 1}))
    assert s.history[2]["num-replies"] == 2 and s.history[2]["rejected-replies"] == 0
    assert s.history[2]["compression-ratio"] > 1.5
    out = {k: res.arrays[k].numpy() for k in init}
    assert all(np.isfinite(v).all() for v in out.values())
    assert sum(float(((out[k] - init[k]) ** 2).sum()) for k in init) > 0


@pytest.mark.parametrize("codec", ["powersgd", "eden"])
def test_zoo_models_round_trip(codec):
    """BatchNorm/LayerNorm/GroupNorm, 0-d and empty parameters, integer buffers, fp16/bf16 models
    (the zoo of tests/model_zoo.py) through mod and strategy with the new codecs."""
    from fedcomp.statedict import to_state_dict
    from tests.model_zoo import ZOO, expected_exact, zoo, zoo_round

    for name in ZOO:
        model = zoo()[name]
        sd, arrays, metrics = zoo_round(model, codec, "tensor")
        assert arrays is not None and metrics["rejected-replies"] == 0, name
        out = to_state_dict(arrays)
        for k, t in sd.items():
            assert out[k].dtype == t.dtype and tuple(out[k].shape) == tuple(t.shape), (name, k)
            if t.is_floating_point():
                assert bool(torch.isfinite(out[k].float()).all()), (name, k)
        for k, want in expected_exact(sd).items():
            assert out[k].tolist() == want, (name, k)
        model.load_state_dict(out)
