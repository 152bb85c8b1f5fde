"""Tied parameters sent as two entries by an app that does not untie them (a Hugging Face model with
tied input/output embeddings, GPT-2's default, whose ``state_dict()`` lists the one tensor twice).
The server finds them in the first global model (bit-identical, random-looking float tensors of one
shape and dtype), logs them once and keeps them tied in every round's aggregate; separate tensors
that merely start at one constant (a residual block's and its shortcut's BatchNorm biases) are left
apart, with no log line."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.serverapp.strategy import FedAdam, FedAvg, FedMedian
from torch import nn

from fedcomp.client import compression_mod
from fedcomp.privacy import ClientLevelDP
from fedcomp.run.inprocess_grid import InProcessGrid
from fedcomp.statedict import FlatModel, to_record
from fedcomp.statedict.tied import equal_groups, find_tied, looks_random, tie_list, tie_record
from fedcomp.strategies import CompressedStrategy, Download, Privacy

KEPT = "kept tied"
CLIENTS = 3


class TinyGPT(nn.Module):
    """GPT-2's layout in miniature: token and position embeddings, a block, a final LayerNorm and an
    output layer tied to the token embedding (``lm_head.weight`` is ``transformer.wte.weight``)."""

    vocab, width, seq = 64, 16, 8

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(self.vocab, self.width)
        self.wpe = nn.Embedding(self.seq, self.width)
        self.ln_1 = nn.LayerNorm(self.width)
        self.mlp = nn.Sequential(nn.Linear(self.width, 2 * self.width), nn.GELU(),
                                 nn.Linear(2 * self.width, self.width))
        self.ln_f = nn.LayerNorm(self.width)
        self.lm_head = nn.Linear(self.width, self.vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        h = h + self.mlp(self.ln_1(h))
        return self.lm_head(self.ln_f(h)).reshape(-1, self.vocab)

    def batch(self, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, self.vocab, (16, self.seq), generator=g)
        return x, ((3 * x + 1) % self.vocab).reshape(-1)


class HFGPT2(nn.Module):
    """Hugging Face's GPT-2 (built from a config: nothing downloaded), ``tie_word_embeddings=True`` as
    by default; its zero biases and LayerNorm weights of one shape are separate tensors."""

    def __init__(self) -> None:
        transformers = pytest.importorskip("transformers", reason="the llm extra (transformers) is not installed")
        super().__init__()
        self.m = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=TinyGPT.vocab, n_embd=16, n_layer=1, n_head=2, n_positions=TinyGPT.seq, bos_token_id=0,
            eos_token_id=0, tie_word_embeddings=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=x).logits.reshape(-1, TinyGPT.vocab)

    vocab, seq, batch = TinyGPT.vocab, TinyGPT.seq, TinyGPT.batch


class ResidualNet(nn.Module):
    """A ResNet block with a projection shortcut: ``bn2`` and the shortcut's BatchNorm start at the
    same constants (biases 0, weights 1, running statistics 0 and 1) and, the sum passing the same
    gradient to both, their biases get identical gradients: separate tensors that start equal."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.shortcut = nn.Sequential(nn.Conv2d(1, 4, 1), nn.BatchNorm2d(4))
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return self.fc(torch.relu(h + self.shortcut(x)).flatten(1))

    def batch(self, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(16, 1, 6, 6, generator=g)
        return x, (x.mean((1, 2, 3)) > 0).long() + (x[:, 0, 0, 0] > 1).long()


class TwinStart(nn.Module):
    """Two separate layers that an app set to the same random values (not tied in the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.left, self.right, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(16, 2)
        with torch.no_grad():
            self.right.weight.copy_(self.left.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.cat([torch.tanh(self.left(x)), torch.relu(self.right(x))], 1))

    def batch(self, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(16, 8, generator=g)
        return x, (x[:, 0] > x[:, 1]).long()


def _build(cls):
    torch.manual_seed(0)
    return cls()


def _third_party_app(cls) -> ClientApp:
    """A plain Flower app behind compression_mod: loads the received state dict into its model and replies
    with the whole ``model.state_dict()`` (a tied tensor under both names), after a few SGD steps."""
    app = ClientApp(mods=[compression_mod])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = _build(cls)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        pid, rnd = int(context.node_config["partition-id"]), int(msg.content["config"]["server-round"])
        g = torch.Generator().manual_seed(100 * pid + rnd)
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
        for _ in range(3):
            x, y = model.batch(g)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                   "metrics": MetricRecord({"num-examples": 16 + pid})}), reply_to=msg)

    return app


def _run(cls, inner, rounds: int = 3, **options) -> tuple[CompressedStrategy, list[ArrayRecord]]:
    """``rounds`` rounds of CLIENTS clients with random-k (density 0.1) upward: the strategy and each
    round's aggregate."""
    grid = InProcessGrid(_third_party_app(cls), CLIENTS, {})
    s = CompressedStrategy(inner, compressor="randomk", density=0.1, **options)
    arrays, aggregates = ArrayRecord(_build(cls).state_dict()), []
    for rnd in range(1, rounds + 1):
        msgs = list(s.configure_train(rnd, arrays, ConfigRecord({}), grid))
        arrays, _ = s.aggregate_train(rnd, grid.send_and_receive(msgs))
        assert arrays is not None and s.history[rnd]["num-replies"] == CLIENTS
        aggregates.append(arrays)
    return s, aggregates


def _kept_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if KEPT in r.getMessage()]


INNER = {
    "fedavg": lambda: (FedAvg(min_available_nodes=CLIENTS, fraction_evaluate=0.0), {}),
    "fedadam": lambda: (FedAdam(min_available_nodes=CLIENTS, fraction_evaluate=0.0, eta=0.05), {}),
    "fedmedian": lambda: (FedMedian(min_available_nodes=CLIENTS, fraction_evaluate=0.0), {}),
    "client-dp": lambda: (FedAvg(min_available_nodes=CLIENTS, fraction_evaluate=0.0),
                          {"privacy": Privacy(client_dp=ClientLevelDP(10.0, 0.1, 1e-5, seed=1))}),
}


@pytest.mark.parametrize("inner", sorted(INNER))
def test_tied_embeddings_sent_twice_stay_bit_identical_in_every_aggregate(inner, caplog):
    strategy, options = INNER[inner]()
    with caplog.at_level(logging.INFO, logger="flwr"):
        s, aggregates = _run(TinyGPT, strategy, **options)
    assert s.tied_groups == [("wte.weight", "lm_head.weight")]
    lines = _kept_lines(caplog)
    assert len(lines) == 1 and "'wte.weight' = 'lm_head.weight'" in lines[0]
    start = _build(TinyGPT).wte.weight.detach().numpy()
    for rnd, arrays in enumerate(aggregates, 1):
        wte, head = arrays["wte.weight"].numpy(), arrays["lm_head.weight"].numpy()
        assert np.array_equal(wte.view(np.uint32), head.view(np.uint32)), f"round {rnd}"
    assert not np.array_equal(aggregates[-1]["wte.weight"].numpy(), start)  # and it trains


def test_hugging_face_gpt2_sent_as_its_state_dict_stays_tied(caplog):
    with caplog.at_level(logging.INFO, logger="flwr"):
        s, aggregates = _run(HFGPT2, FedAvg(min_available_nodes=CLIENTS, fraction_evaluate=0.0), rounds=2)
    assert s.tied_groups == [("m.transformer.wte.weight", "m.lm_head.weight")]  # not its zero biases
    (line,) = _kept_lines(caplog)
    assert "'m.transformer.wte.weight' = 'm.lm_head.weight'" in line
    for arrays in aggregates:
        assert np.array_equal(arrays["m.transformer.wte.weight"].numpy(), arrays["m.lm_head.weight"].numpy())


def test_without_tying_random_k_pulls_the_two_names_apart():
    """What the groups prevent: the same run with ``tied_groups = []`` (nothing tied) aggregates
    the two names as two tensors."""
    grid = InProcessGrid(_third_party_app(TinyGPT), CLIENTS, {})
    s = CompressedStrategy(FedAvg(min_available_nodes=CLIENTS, fraction_evaluate=0.0), compressor="randomk",
                           density=0.1)
    s.tied_groups = []
    arrays = ArrayRecord(_build(TinyGPT).state_dict())
    arrays, _ = s.aggregate_train(1, grid.send_and_receive(list(s.configure_train(1, arrays, ConfigRecord({}), grid))))
    assert s.tied_groups == []
    assert np.abs(arrays["wte.weight"].numpy() - arrays["lm_head.weight"].numpy()).max() > 1e-3


def test_a_seeded_start_does_not_hide_the_tie():
    """``start`` looks for the groups in the model it is given, before a seeded start draws every
    name apart; from round 1 on the aggregate is tied again."""
    grid = InProcessGrid(_third_party_app(TinyGPT), CLIENTS, {})
    s = CompressedStrategy(FedAvg(min_available_nodes=CLIENTS, fraction_evaluate=0.0), compressor="randomk",
                           density=0.1, downstream=Download(init="seeded"))
    result = s.start(grid=grid, initial_arrays=ArrayRecord(_build(TinyGPT).state_dict()), num_rounds=2)
    assert s.tied_groups == [("wte.weight", "lm_head.weight")]
    final = result.arrays
    assert np.array_equal(final["wte.weight"].numpy(), final["lm_head.weight"].numpy())


def test_residual_batchnorm_biases_that_start_at_zero_are_not_tied(caplog):
    """The BatchNorm biases (and weights and statistics) of a block and its shortcut are equal
    constants at the start: not reported, not tied; random-k aggregates them as two tensors."""
    model = _build(ResidualNet)
    sd = model.state_dict()
    assert torch.equal(sd["bn2.bias"], sd["shortcut.1.bias"]) and torch.equal(sd["bn2.weight"], sd["shortcut.1.weight"])
    with caplog.at_level(logging.INFO, logger="flwr"):
        s, aggregates = _run(ResidualNet, FedAvg(min_available_nodes=CLIENTS, fraction_evaluate=0.0), rounds=2)
    assert s.tied_groups == [] and _kept_lines(caplog) == []
    assert not np.array_equal(aggregates[0]["bn2.bias"].numpy(), aggregates[0]["shortcut.1.bias"].numpy())


def test_residual_biases_aggregate_as_without_the_groups():
    """No group found: the aggregates are bit for bit those of a strategy told to tie nothing."""
    _, found = _run(ResidualNet, FedAvg(min_available_nodes=CLIENTS, fraction_evaluate=0.0), rounds=2)
    grid = InProcessGrid(_third_party_app(ResidualNet), CLIENTS, {})
    s = CompressedStrategy(FedAvg(min_available_nodes=CLIENTS, fraction_evaluate=0.0), compressor="randomk",
                           density=0.1)
    s.tied_groups = []
    arrays = ArrayRecord(_build(ResidualNet).state_dict())
    for rnd in (1, 2):
        arrays, _ = s.aggregate_train(rnd, grid.send_and_receive(list(s.configure_train(rnd, arrays, ConfigRecord({}),
                                                                                        grid))))
        for k in arrays:
            assert np.array_equal(arrays[k].numpy(), found[rnd - 1][k].numpy()), (rnd, k)


def test_separate_tensors_that_start_equal_and_random_are_named_in_the_log(caplog):
    """Two layers an app set to the same random weights cannot be told from one tied tensor: the log
    line names both (and says what to do if they are separate); they are kept tied."""
    with caplog.at_level(logging.INFO, logger="flwr"):
        s, aggregates = _run(TwinStart, FedAvg(min_available_nodes=CLIENTS, fraction_evaluate=0.0), rounds=2)
    assert s.tied_groups == [("left.weight", "right.weight")]  # the biases were drawn apart
    (line,) = _kept_lines(caplog)
    assert "'left.weight' = 'right.weight'" in line and "merely start equal" in line and "tied_groups = []" in line
    assert np.array_equal(aggregates[-1]["left.weight"].numpy(), aggregates[-1]["right.weight"].numpy())


# -- the legacy wrapper ------------------------------------------------------------------------------

def test_legacy_wrapper_keeps_tied_arrays_tied(caplog):
    from flwr.client import NumPyClient
    from flwr.server.strategy import FedAvg as LegacyFedAvg

    from fedcomp.client.numpy_client import CompressedNumPyClient
    from fedcomp.strategies.legacy_strategy import LegacyCompressedStrategy

    from .legacy_helpers import manager

    keys = list(_build(TinyGPT).state_dict())

    class Client(NumPyClient):  # get/set parameters the way Flower's PyTorch examples do: every state_dict entry
        def __init__(self, pid: int) -> None:
            self.pid = pid

        def fit(self, parameters, config):
            model = _build(TinyGPT)
            model.load_state_dict({k: torch.from_numpy(np.array(a)) for k, a in zip(keys, parameters)})
            g = torch.Generator().manual_seed(self.pid)
            opt = torch.optim.SGD(model.parameters(), lr=0.3)
            x, y = model.batch(g)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            return [t.detach().numpy().copy() for t in model.state_dict().values()], 16, {}

    initial = [t.detach().numpy().copy() for t in _build(TinyGPT).state_dict().values()]
    s = LegacyCompressedStrategy(LegacyFedAvg(fraction_evaluate=0.0, min_fit_clients=CLIENTS,
                                              min_available_clients=CLIENTS), compressor="randomk", density=0.1)
    cm = manager([CompressedNumPyClient(Client(i)) for i in range(CLIENTS)])
    params = ndarrays_to_parameters(initial)
    wte, head = str(keys.index("wte.weight")), str(keys.index("lm_head.weight"))
    with caplog.at_level(logging.INFO, logger="flwr"):
        for rnd in (1, 2):
            results = [(proxy, proxy.fit(ins, None, rnd)) for proxy, ins in s.configure_fit(rnd, params, cm)]
            params, metrics = s.aggregate_fit(rnd, results, [])
            out = parameters_to_ndarrays(params)
            assert metrics["num-replies"] == CLIENTS
            assert np.array_equal(out[int(wte)], out[int(head)]), rnd
    assert s.tied_groups == [(wte, head)]
    (line,) = _kept_lines(caplog)
    assert f"'{wte}' = '{head}'" in line
    assert not np.array_equal(out[int(wte)], initial[int(wte)])


# -- the pieces ----------------------------------------------------------------------------------------

def test_only_random_looking_bit_identical_tensors_of_one_shape_and_dtype_are_grouped():
    rng = np.random.default_rng(0)
    r = rng.standard_normal((6, 5)).astype(np.float32)
    values = {
        "a": r, "b": r.copy(), "c": r.copy(),  # a group of three
        "reshaped": r.reshape(5, 6).copy(),  # another shape
        "zeros1": np.zeros(30, np.float32), "zeros2": np.zeros(30, np.float32),  # constants
        "ones1": np.ones(30, np.float32), "ones2": np.ones(30, np.float32),
        "mask1": np.tile([0.0, 1.0], 15).astype(np.float32), "mask2": np.tile([0.0, 1.0], 15).astype(np.float32),
        "tiny1": r.ravel()[:8].copy(), "tiny2": r.ravel()[:8].copy(),  # too few entries to tell
        "near": r.copy(), "i1": np.arange(30), "i2": np.arange(30),  # integers never
    }
    values["near"].flat[7] = np.nextafter(values["near"].flat[7], np.float32(9))  # one ulp apart
    assert equal_groups(FlatModel.from_numpy(values)) == [("a", "b", "c")]
    h = {"x": r.astype(np.float16), "y": r.astype(np.float16), "z": r.astype(np.float32)}  # dtype counts
    assert equal_groups(FlatModel.from_numpy(h)) == [("x", "y")]
    assert not looks_random(np.zeros(1000, np.float32)) and looks_random(rng.standard_normal(16))


class Seq2Seq(nn.Module):
    """T5's and BART's sharing: one embedding under four names, next to layers drawn apart."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(30, 8)
        self.encoder, self.decoder = nn.Module(), nn.Module()
        self.encoder.embed_tokens, self.encoder.proj = self.shared, nn.Linear(8, 8)
        self.decoder.embed_tokens, self.decoder.proj = self.shared, nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 30, bias=False)
        self.lm_head.weight = self.shared.weight


class WithTeacher(nn.Module):
    """A student and its EMA teacher, made by ``copy.deepcopy``: every tensor starts equal to its copy."""

    def __init__(self) -> None:
        import copy

        super().__init__()
        self.student = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2, bias=False))
        self.teacher = copy.deepcopy(self.student)


def test_copies_of_a_module_are_not_tied_but_a_tensor_shared_by_four_names_is(caplog):
    """The layers of torch.nn.TransformerEncoder are deep copies of one layer, and an EMA teacher a deep copy
    of its student: each random tensor equals its copy's at the start, but so does every other one under
    the two modules (a copy, not a tie). T5/BART's embedding under four names is one group."""
    def groups(model: nn.Module) -> list[tuple[str, ...]]:
        return equal_groups(FlatModel.from_record(to_record(model.state_dict())))

    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 3,
                                    enable_nested_tensor=False)
    sd = encoder.state_dict()
    assert torch.equal(sd["layers.0.linear1.weight"], sd["layers.2.linear1.weight"])
    with caplog.at_level(logging.INFO, logger="flwr"):
        assert find_tied(FlatModel.from_record(to_record(sd))) == []
    assert _kept_lines(caplog) == []
    assert groups(WithTeacher()) == []  # the last layer has no bias: its weight alone would look tied
    assert groups(Seq2Seq()) == [("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
                                  "lm_head.weight")]


def test_bf16_tensors_are_grouped_and_tied_in_their_dtype():
    t = torch.randn(8, 4).to(torch.bfloat16)
    record = to_record({"e": t, "h": t.clone(), "o": torch.randn(3)})
    groups = equal_groups(FlatModel.from_record(record))
    assert groups == [("e", "h")]
    record["h"] = to_record({"h": (t.float() + 0.5).to(torch.bfloat16)})["h"]
    tie_record(record, groups)
    assert record["e"].dtype == record["h"].dtype == "bfloat16" and record["e"].data == record["h"].data


def _record(values: dict) -> ArrayRecord:
    return ArrayRecord({k: Array(v) for k, v in values.items()})


def test_tying_gives_every_name_the_mean_and_leaves_equal_or_foreign_groups_alone():
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.arange(6, dtype=np.float32).reshape(2, 3) + 1
    record = _record({"a": a, "b": b, "c": np.ones(3, np.float32)})
    tie_record(record, [("a", "b"), ("c", "missing")])
    assert np.array_equal(record["a"].numpy(), a + 0.5) and np.array_equal(record["b"].numpy(), a + 0.5)
    kept = _record({"a": a, "b": a.copy(), "s": np.ones(3, np.float32)})
    before = {k: kept[k] for k in kept}
    tie_record(kept, [("a", "b"), ("a", "s")])  # already equal; another shape
    assert all(kept[k] is before[k] for k in kept)
    out = tie_list([a, np.zeros(2), b], [("0", "2")])
    assert np.array_equal(out[0], out[2]) and out[0] is not out[2] and np.array_equal(out[1], np.zeros(2))
