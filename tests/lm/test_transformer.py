"""``dataset = "shakespeare"``, ``model = "transformer"``: the Hugging Face causal LM through every codec
in the in-process federation, AdamW and bf16 autocast, on the small local corpus (no network)."""

import logging

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedcomp.app.client_app import app as client_app
from fedcomp.app.config import AppConfig
from fedcomp.task.data import DataConfig, load_partition, load_test_set
from fedcomp.task.lm import build_transformer, transformer_config
from fedcomp.task.models import build_model
from fedcomp.task.objective import loss_and_hits
from fedcomp.app.server_app import build_inner, concern_options
from fedcomp.run.inprocess_grid import InProcessGrid
from fedcomp.statedict import to_state_dict
from fedcomp.strategies import CompressedStrategy
from fedcomp.task.training import TrainConfig, evaluate, make_optimizer, train

logging.getLogger("flwr").setLevel(logging.WARNING)
NODES = 2
LN_256 = 5.545  # loss of a uniform guess over 256 bytes


def run(rounds: int, **rc):
    run_config = {"dataset": "shakespeare", "model": "transformer", "num-server-rounds": rounds, "seed": 3,
                  "batch-size": 8, "optimizer": "adamw", "lr": 0.003, **rc}
    cfg = AppConfig.from_run_config(run_config)
    strategy = CompressedStrategy.from_codec_config(build_inner(cfg), cfg.codec, **concern_options(cfg))
    grid = InProcessGrid(client_app, NODES, run_config)
    test = load_test_set(DataConfig(cfg.dataset, cfg.partitioner, cfg.dirichlet_alpha, cfg.seed))
    model, evals = build_model("transformer", (80,)), []

    def evaluate_fn(rnd, arrays):
        model.load_state_dict(to_state_dict(arrays))
        evals.append(evaluate(model, test, torch.device("cpu")))

    torch.manual_seed(cfg.seed)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(build_model("transformer", (80,)).state_dict()),
                            num_rounds=rounds, train_config=ConfigRecord({"seed": cfg.seed}), evaluate_fn=evaluate_fn)
    return result.arrays, evals, strategy


def test_transformer_is_a_small_llama_built_locally():
    model = build_model("transformer", (80,))
    sd = model.state_dict()
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 164_160 and len(sd) == 21
    assert all(t.dtype == torch.float32 for t in sd.values())
    assert "model.layers.0.self_attn.q_proj.weight" in sd and "lm_head.weight" in sd
    x = torch.randint(0, 256, (3, 80))
    assert model(x).logits.shape == (3, 80, 256)
    # causal: the prediction at position t does not depend on later bytes
    x2 = x.clone()
    x2[:, 40:] = (x2[:, 40:] + 1) % 256
    model.eval()
    assert torch.allclose(model(x).logits[:, :40], model(x2).logits[:, :40], atol=1e-5)
    seeded = [build_transformer(transformer_config(), seed=7).state_dict() for _ in range(2)]
    assert all(torch.equal(seeded[0][k], seeded[1][k]) for k in seeded[0])


@pytest.mark.parametrize("codec,extra", [
    ("none", {}), ("fp16", {}), ("bf16", {}), ("sign", {}), ("stc", {"density": 0.05}),
    ("topk", {"density": 0.05}), ("randomk", {"density": 0.3}), ("qsgd", {}), ("int8", {}), ("eden", {}),
    ("powersgd", {"rank": 2}),
])
def test_transformer_federates_with_every_codec(corpus, codec, extra):
    arrays, evals, strategy = run(1, compressor=codec, **extra)
    ref = build_model("transformer", (80,)).state_dict()
    out = to_state_dict(arrays)
    assert list(out) == list(ref)
    assert all(out[k].dtype == torch.float32 and out[k].shape == ref[k].shape for k in ref)
    h = strategy.history[1]
    assert h["num-replies"] == NODES and h["rejected-replies"] == 0 and h["failed-clients"] == 0
    dense = NODES * 164_160 * 4
    assert h["upload-bytes"] <= dense * 1.01
    if codec in ("sign", "stc", "topk", "eden"):
        assert h["upload-bytes"] < dense / 16
    (loss0, _), (loss1, _) = evals
    assert abs(loss0 - LN_256) < 0.05 and loss1 < loss0 - 0.05, evals


def _data(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(97, 101, (n, 80), generator=g)  # four letters: learnable in a few steps
    return torch.utils.data.TensorDataset(x[:, :-1].contiguous(), x[:, 1:].contiguous())


def test_adamw_uses_its_betas_and_learns():
    model = build_transformer(transformer_config(), seed=1)
    cfg = TrainConfig(batch_size=4, lr=0.003, optimizer="adamw", beta1=0.5, beta2=0.99, weight_decay=0.01)
    opt = make_optimizer(model.parameters(), cfg)
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.param_groups[0]["betas"] == (0.5, 0.99) and opt.param_groups[0]["weight_decay"] == 0.01
    data = _data()
    before = evaluate(model, data, torch.device("cpu"))[0]
    loss, n = train(model, data, cfg, torch.device("cpu"), seed=0)
    assert n == 16 and abs(loss - before) < 1.0
    assert evaluate(model, data, torch.device("cpu"))[0] < before - 0.5
    with pytest.raises(ValueError, match="optimizer must be one of"):
        make_optimizer(model.parameters(), TrainConfig(optimizer="adam"))


def test_bf16_autocast_keeps_fp32_weights_and_tracks_fp32_training():
    data = _data()
    models = {p: build_transformer(transformer_config(), seed=2) for p in ("fp32", "bf16")}
    for p, m in models.items():
        train(m, data, TrainConfig(batch_size=4, lr=0.003, optimizer="adamw", precision=p), torch.device("cpu"))
    for k, t in models["bf16"].state_dict().items():
        assert t.dtype == torch.float32, k  # master weights stay fp32, so the update and residual are fp32
    a, b = (evaluate(m, data, torch.device("cpu"))[0] for m in models.values())
    assert abs(a - b) < 0.1, (a, b)
    logits = torch.randn(2, 5, 256, dtype=torch.bfloat16)
    loss, _, count = loss_and_hits(logits, torch.zeros(2, 5, dtype=torch.int64))
    assert loss.dtype == torch.float32 and count == 10


def test_loss_and_hits_counts_characters_and_ignores_masked_targets():
    logits = torch.full((1, 3, 4), -10.0)
    logits[0, 0, 1] = logits[0, 1, 2] = logits[0, 2, 3] = 10.0
    _, hits, count = loss_and_hits(logits, torch.tensor([[1, 2, 0]]))
    assert (hits, count) == (2, 3)
    _, hits, count = loss_and_hits(logits, torch.tensor([[1, -100, 0]]))
    assert (hits, count) == (1, 2)
    with pytest.raises(ValueError, match="do not match targets"):
        loss_and_hits(logits, torch.tensor([1, 2, 0]))


def test_run_config_keys_for_the_llm_path():
    cfg = AppConfig.from_run_config({"dataset": "shakespeare", "model": "transformer", "optimizer": "adamw",
                                     "adam-beta1": 0.5, "precision": "bf16", "weight-decay": 0.1})
    assert (cfg.optimizer, cfg.adam_beta1, cfg.adam_beta2, cfg.precision, cfg.weight_decay) == \
        ("adamw", 0.5, 0.999, "bf16", 0.1)
    for bad, msg in [({"optimizer": "adam"}, "'optimizer' must be one of"),
                     ({"adam-beta1": 1.0}, "'adam-beta1' must be in"), ({"precision": "fp16"}, "'precision'"),
                     ({"dataset": "shakespeare"}, "goes with model = 'transformer'"),
                     ({"dp": "dp-sgd", "optimizer": "adamw"}, "trains with optimizer = 'sgd'")]:
        with pytest.raises(ValueError, match=msg):
            AppConfig.from_run_config(bad)


def test_client_partition_of_the_corpus_is_the_roles_windows(corpus):
    data = load_partition(DataConfig("shakespeare", seed=3), 1, NODES)
    x, y = data.tensors
    assert x.dtype == torch.int64 and x.shape[1] == 80 and torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_gradient_accumulation_matches_one_larger_batch(optimizer):
    """4 windows x 2 accumulation steps = one step on 8 windows (mean over characters either way)."""
    data = _data(n=8, seed=3)
    models = [build_transformer(transformer_config(), seed=4) for _ in range(2)]
    base = {"lr": 0.01, "momentum": 0.0, "optimizer": optimizer}
    train(models[0], data, TrainConfig(batch_size=8, accumulation_steps=1, **base), torch.device("cpu"), seed=5)
    train(models[1], data, TrainConfig(batch_size=4, accumulation_steps=2, **base), torch.device("cpu"), seed=5)
    start = build_transformer(transformer_config(), seed=4).state_dict()
    a, b = models[0].state_dict(), models[1].state_dict()
    moved = max(float((a[k] - start[k]).abs().max()) for k in a)
    assert moved > 1e-4  # the step did something
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 0.01 * moved  # float summation order only
