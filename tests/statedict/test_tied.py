"""Tied parameters stay tied: a model whose output layer shares the embedding's
weight (Hugging Face ``tie_word_embeddings=True``, or ``head.weight = emb.weight``) sends that tensor
once, the server aggregates it once, and loading the aggregate sets both names (one tensor)."""

import logging

import pytest
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from torch import nn

from fedcomp.client import compression_mod
from fedcomp.statedict import FlatModel, retie, tied_aliases, untie
from fedcomp.strategies import CompressedStrategy
from fedcomp.task.lora import load_weights, weights_record
from tests.messages import make_ctx, make_msg

logging.getLogger("flwr").setLevel(logging.WARNING)


class TiedLM(nn.Module):
    """Embedding, a hidden layer with BatchNorm, and an output layer tied to the embedding."""

    def __init__(self, vocab: int = 50, width: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight


def _hf(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="the llm extra (transformers) is not installed")
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    else:
        config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=16,
                                         bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)
    return transformers.AutoModelForCausalLM.from_config(config)


MODELS = {
    "torch": (lambda: (torch.manual_seed(0), TiedLM())[1], "emb.weight", "head.weight"),
    "llama": (lambda: _hf("llama"), "model.embed_tokens.weight", "lm_head.weight"),
    "gpt2": (lambda: _hf("gpt2"), "transformer.wte.weight", "lm_head.weight"),
}


def _federated_round(build, codec: str, selection: str, clients: int = 2):
    """One round: every client loads the global model, moves every parameter (the tied one once, as
    an optimizer does), replies with :func:`weights_record` through compression_mod; the server
    aggregates. Returns (initial record, aggregate record, upload bytes)."""
    server = build()
    initial = weights_record(server, lora=False)
    strategy = CompressedStrategy(FedAvg(), compressor=codec, density=0.3, selection=selection)
    config = {"server-round": 1, **strategy.codec.to_mapping()}
    strategy.remember(1, FlatModel.from_record(initial))
    replies = []
    for i in range(clients):
        msg = make_msg(RecordDict({"arrays": weights_record(server, lora=False), "config": ConfigRecord(config)}),
                       dst=10 + i)

        def train(m, c, i=i):
            model = build()
            load_weights(model, m.content["arrays"], lora=False)
            gen = torch.Generator().manual_seed(i)
            with torch.no_grad():
                for p in model.parameters():  # each tied tensor once
                    p.add_(0.01 * torch.randn(p.shape, generator=gen))
            return Message(content=RecordDict({"arrays": weights_record(model, lora=False),
                                               "metrics": MetricRecord({"num-examples": 10 + i})}), reply_to=m)

        replies.append(compression_mod(msg, make_ctx(node_id=10 + i), train))
    arrays, _ = strategy.aggregate_train(1, replies)
    metrics = strategy.history[1]  # the round's own figures (Flower gets the headline ones)
    assert metrics["rejected-replies"] == 0 and arrays is not None
    return initial, arrays, metrics["upload-bytes"]


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_tied_weight_is_found_as_an_alias(kind):
    build, source, alias = MODELS[kind]
    model = build()
    assert tied_aliases(model.state_dict()) == {alias: source}
    assert alias not in untie(model.state_dict()) and source in untie(model.state_dict())


@pytest.mark.parametrize("codec,selection", [("topk", "model"), ("qsgd", "tensor")])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_tied_parameters_travel_once_and_stay_tied_after_aggregation(kind, codec, selection):
    build, source, alias = MODELS[kind]
    initial, arrays, _ = _federated_round(build, codec, selection)
    # before: both names travelled (the tied tensor's bytes twice) and were aggregated apart (Llama,
    # top-k over the model: the two copies of lm_head differed by up to 0.0049 after one round)
    assert alias not in initial and alias not in arrays
    assert source in arrays
    model = build()
    load_weights(model, arrays, lora=False)  # strict load: the alias is set from its source
    sd = model.state_dict()
    assert sd[alias].data_ptr() == sd[source].data_ptr()  # still one tensor
    assert torch.equal(sd[alias], torch.from_numpy(arrays[source].numpy()))
    moved = torch.from_numpy(arrays[source].numpy()) - torch.from_numpy(initial[source].numpy())
    assert float(moved.abs().max()) > 0  # the tied weight was updated (once, by both clients)


def test_a_sender_that_did_not_untie_gets_the_sources_value_under_both_names():
    model = TiedLM()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["head.weight"] = sd["head.weight"] + 1.0  # an older client's copy that came apart
    model.load_state_dict(retie(sd, tied_aliases(model.state_dict())))
    assert torch.equal(model.head.weight, sd["emb.weight"]) and model.head.weight is model.emb.weight


def test_retie_names_a_missing_source():
    with pytest.raises(ValueError, match="'head.weight' is tied to 'emb.weight', which the received weights do not"):
        retie({"hidden.weight": torch.zeros(1)}, {"head.weight": "emb.weight"})


def test_views_that_only_overlap_and_empty_tensors_are_not_aliases():
    base = torch.arange(12.0)
    sd = {"a": base, "b": base[:6], "c": base.view(3, 4), "d": torch.zeros(0), "e": torch.zeros(0), "f": base}
    assert tied_aliases(sd) == {"f": "a"}  # b: part of a; c: another shape; d, e: no memory
