"""LoRA fine-tuning: only adapters travel, compressed both ways, the frozen base
is untouched, the server starts from a seed instead of a dense broadcast, lagging clients get a
small catch-up, and a base model that cannot be loaded is a clear error."""

import logging
import math

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord
from flwr.serverapp.strategy import FedAvg

from fedcomp.app.lora_client_app import eval_lm, lora_client_app, lora_model
from fedcomp.task.lora import (
    LoraSettings,
    adapter_shapes,
    adapter_state,
    base_fingerprint,
    initial_adapters,
    load_base_model,
    wrap,
)
from fedcomp.protocol.messages import MODEL_STATE_KEY, PAYLOAD_STYPE
from fedcomp.download.seeded_init import INIT_STYPE
from fedcomp.run.inprocess_grid import InProcessGrid
from fedcomp.statedict import to_record
from fedcomp.strategies import CompressedStrategy, Download

from .helpers import windows

logging.getLogger("flwr").setLevel(logging.WARNING)


def _settings(base_dir, **kw):
    return LoraSettings(base_dir, r=kw.get("r", 4), alpha=kw.get("alpha", 8.0))


def test_bad_base_model_is_a_clear_error(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # the hub path, without waiting
    with pytest.raises(ValueError, match="no such directory"):
        load_base_model(LoraSettings(str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="not a model saved with save_pretrained"):
        load_base_model(LoraSettings(str(tmp_path)))
    with pytest.raises(ValueError, match="hub id could not be loaded"):
        load_base_model(LoraSettings("nobody-here/no-such-model"))
    with pytest.raises(ValueError, match="hub id could not be loaded"):
        adapter_shapes(LoraSettings("nobody-here/no-such-model"))  # the server's path too
    with pytest.raises(ValueError, match="'base-model' must name"):
        LoraSettings.from_mapping({"finetune": "lora"})
    with pytest.raises(ValueError, match="lora-r"):
        LoraSettings.from_mapping({"base-model": "x", "lora-r": 0})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message")
def test_4bit_on_cpu_says_why(base_dir):
    with pytest.raises(ValueError, match="needs CUDA"):
        load_base_model(LoraSettings(base_dir, quantization="4bit"))


def test_server_learns_adapter_shapes_from_the_config_alone(base_dir):
    s = _settings(base_dir)
    real = adapter_state(wrap(load_base_model(s), s))
    shapes = adapter_shapes(s)
    assert shapes == {k: tuple(v.shape) for k, v in real.items()}
    assert len(shapes) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)
    init, seeded = initial_adapters(s, seed=5)
    for k, v in init.items():
        assert v.dtype == torch.float32
        if ".lora_B." in k:
            assert not v.any()
        else:  # peft's kaiming_uniform_(a=sqrt(5)): uniform in +-1/sqrt(fan_in), fan_in = 32
            assert 0.9 / 32**0.5 < float(v.abs().max()) <= 1 / 32**0.5
    again, _ = initial_adapters(s, seed=5)
    assert all(torch.equal(init[k], again[k]) for k in init)


def _federation(base_dir, codec, downstream, nodes=3, fraction=1.0, **params):
    s = _settings(base_dir)
    run_config = {"base-model": base_dir, "lora-r": 4, "lora-alpha": 8.0, "local-steps": 4, "batch-size": 8,
                  "lr": 2e-2}
    app = lora_client_app(lambda ctx: windows(int(ctx.node_config["partition-id"])))
    grid = InProcessGrid(app, nodes, run_config)
    init, seeded = initial_adapters(s, seed=7)
    strategy = CompressedStrategy(FedAvg(fraction_train=fraction, min_train_nodes=1, min_available_nodes=nodes,
                                         fraction_evaluate=0.0), compressor=codec,
                                  downstream=Download(downstream, init=seeded), **params)
    return s, grid, strategy, to_record(init)


@pytest.mark.parametrize("codec", ["sign", "stc", "topk", "int8", "qsgd", "eden", "none"])
def test_only_compressed_adapters_travel_and_the_base_stays_frozen(base_dir, codec):
    s, grid, strategy, arrays = _federation(base_dir, codec, "sign", nodes=2, density=0.1)
    model = lora_model(s)
    before = base_fingerprint(model)
    adapter_keys = set(arrays.keys())
    dense = sum(len(a.data) for a in arrays.values())
    sent_log = []
    for rnd in (1, 2):
        msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord({"seed": 1}), grid))
        for m in msgs:  # download: seeded-init rules or payloads, never dense weights, never base weights
            rec = m.content["arrays"]
            assert all(a.stype in (INIT_STYPE, PAYLOAD_STYPE) for a in rec.values())
            assert set(rec.keys()) <= adapter_keys | {"fedcomp.model"}
            sent_log.append(sum(len(a.data) for a in rec.values()))
        replies = grid.send_and_receive(msgs)
        for r in replies:  # upload: compressed adapter updates only
            rec = next(iter(r.content.array_records.values()))
            assert all(a.stype == PAYLOAD_STYPE for a in rec.values())
            assert set(rec.keys()) <= adapter_keys | {"fedcomp.model"}
        arrays, _ = strategy.aggregate_train(rnd, replies)
        assert set(arrays.keys()) == adapter_keys
    assert base_fingerprint(model) == before  # the frozen base is untouched, bit for bit
    assert max(sent_log[:2]) == 8 * len(adapter_keys)  # round 1: one bound per tensor
    # round 2: a 1-bit payload of the change, one per adapter tensor (its own scale): count, and per
    # tensor its length, the 22-byte header of a 1-d sign payload and the packed signs
    per_tensor = 8 + sum(4 + 22 + -(-math.prod(a.shape) // 8) for a in arrays.values())
    assert sent_log[2:] == [per_tensor, per_tensor] and per_tensor < dense / 12
    h = strategy.history[2]
    bits = {"sign": 1.1, "stc": 1, "topk": 5, "int8": 9, "qsgd": 6, "eden": 1.3, "none": 33}[codec]
    assert h["upload-bytes"] < 2 * (dense * bits / 32 + 8 * 48)  # 2 clients, at most 8 payload headers each


def test_fine_tuning_lowers_the_loss_and_lagging_clients_catch_up_cheaply(base_dir):
    s, grid, strategy, arrays = _federation(base_dir, "sign", "sign", nodes=4, fraction=0.5)
    model = lora_model(s)
    from fedcomp.task.lora import load_adapters
    from fedcomp.statedict import to_state_dict

    test = torch.utils.data.ConcatDataset([windows(p, 16) for p in range(4)])
    load_adapters(model, to_state_dict(arrays))
    loss0, _ = eval_lm(model, test)
    dense = sum(len(a.data) for a in arrays.values())
    kinds = []
    for rnd in range(1, 7):
        msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord({"seed": 1}), grid))
        replies = grid.send_and_receive(msgs)
        arrays, _ = strategy.aggregate_train(rnd, replies)
        for m in msgs:
            node = m.metadata.dst_node_id
            kinds.append(strategy.downstream.sent_kind[node])
            assert strategy.downstream.sent_bytes[node] < dense / 12  # never dense: seeds, payloads, diffs
            # (a step is one payload per adapter tensor: 26 bytes of header each, a third of 1,280 entries' signs)
            held = grid.contexts[node].state[MODEL_STATE_KEY]
            assert np.array_equal(np.concatenate([a.numpy().ravel() for a in held.values()]),
                                  strategy.downstream.held(node))
    assert {"init", "payload"} <= set(kinds) and ({"diff", "init+diff"} & set(kinds))
    load_adapters(model, to_state_dict(arrays))
    loss1, _ = eval_lm(model, test)
    assert loss1 < loss0 - 0.05  # fine-tuning helped (synthetic patterns are learnable)


def test_run_config_lora_keys_are_checked():
    from fedcomp.app.config import AppConfig

    lora = {"dataset": "shakespeare", "model": "transformer", "finetune": "lora"}
    with pytest.raises(ValueError, match="'base-model' must name"):
        AppConfig.from_run_config(lora)
    with pytest.raises(ValueError, match="lora-alpha"):
        AppConfig.from_run_config({**lora, "base-model": "x", "lora-alpha": 0})
    with pytest.raises(ValueError, match="dataset = 'shakespeare'"):
        AppConfig.from_run_config({"finetune": "lora", "base-model": "x"})
    with pytest.raises(ValueError, match="did you mean 'lora-r'"):
        AppConfig.from_run_config({**lora, "base-model": "x", "lora-rr": 4})
    assert AppConfig.from_run_config({**lora, "base-model": "x"}).finetune == "lora"
