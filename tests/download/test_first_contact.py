"""A client's first model without the dense download.

- ``Download(init="seeded")``: every float tensor is replaced by a seeded draw with its mean and
  variance (constants stay exact); a new client builds it from the seed, bit for bit, for every
  kind of state_dict (BatchNorm, integer/bool buffers, 0-d and zero-element parameters, fp16, bf16).
- ``"auto"``: LoRA adapters at peft's initialisation get a seeded start without any seeding code in
  the app; any other model a compressed start (int8), which later catch-ups correct.
"""

import math
import struct

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from torch import nn

from fedcomp.download.receiver import rebuild
from fedcomp.compression import PayloadError
from fedcomp.config import CodecConfig
from fedcomp.download.seeded_init import INIT_SEED, INIT_STYPE, parse_rule, seeded_like
from fedcomp.statedict import to_record, to_state_dict
from fedcomp.download.sender import Downstream
from tests.messages import make_ctx, make_msg
from tests.model_zoo import ZOO, trained_state, zoo


def _first_contact(ds: Downstream, record: ArrayRecord, node: int = 5):
    """One round-1 message to a new node: (what the node rebuilt, the message's bytes, its kind)."""
    msg = make_msg(RecordDict({"arrays": record, "config": ConfigRecord({"server-round": 1})}), dst=node)
    ds.prepare(1, record, [msg])
    ctx = make_ctx(node_id=node)
    rebuilt = rebuild(msg, ctx, "arrays", msg.content["arrays"], dict(msg.content["config"]))
    ds.received(node)
    return to_state_dict(rebuilt), ds.sent_bytes[node], ds.sent_kind[node], ctx


def test_seeded_like_keeps_constants_exact_and_matches_mean_and_variance():
    torch.manual_seed(0)
    lin = nn.Linear(256, 128)  # PyTorch's default: uniform in +-1/sqrt(256)
    arrays = {"w": lin.weight.detach().numpy(), "b": np.zeros(128, np.float32), "g": np.ones(7, np.float32),
              "s": np.array(0.5, np.float32), "e": np.zeros((0, 3), np.float32),
              "shifted": np.linspace(2.0, 4.0, 1000).astype(np.float32)}
    init = seeded_like(arrays, seed=3)
    out = init.values({k: v.shape for k, v in arrays.items()})
    assert np.array_equal(out["b"], arrays["b"]) and np.array_equal(out["g"], arrays["g"])
    assert out["s"].shape == () and out["s"] == np.float32(0.5) and out["e"].shape == (0, 3)
    assert init.bounds["w"] == pytest.approx(math.sqrt(3) * float(arrays["w"].std()))
    assert abs(float(out["w"].std()) / float(arrays["w"].std()) - 1) < 0.02
    assert float(np.abs(out["w"]).max()) <= 1 / 16 * 1.01  # within PyTorch's own bound, as the original
    assert abs(float(out["shifted"].mean()) - 3.0) < 0.02 and abs(float(out["shifted"].std()) - 0.5774) < 0.02
    assert not np.array_equal(out["w"], arrays["w"])  # a new draw, not the original values
    with pytest.raises(ValueError, match="non-finite"):
        seeded_like({"w": np.array([1.0, np.nan], np.float32)}, seed=1)


def test_a_seeded_rule_is_8_or_16_bytes_and_finite():
    assert parse_rule("a", struct.pack("<d", 0.25)) == (0.25, 0.0)
    assert parse_rule("a", struct.pack("<dd", 0.25, 1.0)) == (0.25, 1.0)
    for bad in (b"\0" * 12, struct.pack("<dd", 0.1, math.nan), struct.pack("<d", -1.0),
                struct.pack("<dd", math.inf, 0)):
        with pytest.raises(ValueError, match="seeded-init rule"):
            parse_rule("a", bad)
    # the client names the tensor and refuses before building anything
    rec = ArrayRecord({"w": Array(dtype="float32", shape=(3,), stype=INIT_STYPE, data=b"\0" * 12)})
    msg = make_msg(RecordDict({"arrays": rec, "config": ConfigRecord({"fedcomp-model-version": 1, INIT_SEED: 1})}))
    with pytest.raises(PayloadError, match="'w'"):
        rebuild(msg, make_ctx(), "arrays", rec, dict(msg.content["config"]))


@pytest.mark.parametrize("name", ZOO)
def test_a_seeded_start_is_rebuilt_bit_for_bit_for_every_state_dict(name):
    """Every tensor of the seeded model (BatchNorm statistics, integer/bool buffers, 0-d, fp16, bf16)
    arrives exactly; the message costs a few bytes per float tensor, not the model."""
    sd = zoo()[name].state_dict()
    ds = Downstream(CodecConfig(compressor="stc"), "stc", init="seeded")
    start = to_state_dict(ds.start_model(to_record(sd)))
    rebuilt, sent, kind, ctx = _first_contact(ds, to_record(start))
    assert kind == "init"
    for k, t in start.items():
        assert rebuilt[k].dtype == t.dtype == sd[k].dtype and tuple(rebuilt[k].shape) == tuple(sd[k].shape), k
        assert torch.equal(rebuilt[k], t), k  # bit for bit
        if not t.is_floating_point():
            assert torch.equal(t, sd[k]), k  # integer/bool tensors are kept, not seeded
    exact = sum(t.numel() * t.element_size() for k, t in sd.items()
                if not t.is_floating_point() or k.rsplit(".", 1)[-1] in ("running_mean", "running_var"))
    assert sent <= exact + 150 * len(sd)  # rules of 8-16 bytes; exact tensors as arrays (npy header ~128 bytes)
    # round 2 goes on from the seeded copy with an ordinary payload
    trained = trained_state(start, 1)
    msg = make_msg(RecordDict({"arrays": to_record(trained), "config": ConfigRecord({"server-round": 2})}), dst=5)
    ds.prepare(2, to_record(trained), [msg])
    assert ds.sent_kind[5] == "payload"
    rebuild(msg, ctx, "arrays", msg.content["arrays"], dict(msg.content["config"]))


def _adapters(b_zero: bool = True) -> dict[str, torch.Tensor]:
    """Two LoRA adapters as peft initialises them (A Kaiming-uniform with a = sqrt(5), B zero)."""
    torch.manual_seed(1)
    out = {}
    for layer in ("q_proj", "v_proj"):
        a = torch.empty(4, 32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        out[f"model.layers.0.self_attn.{layer}.lora_A.weight"] = a
        out[f"model.layers.0.self_attn.{layer}.lora_B.weight"] = (torch.zeros(32, 4) if b_zero
                                                                   else 0.01 * torch.ones(32, 4))
    return out


def test_auto_seeds_lora_adapters_at_peft_init_without_seeding_code_in_the_app():
    adapters = _adapters()
    ds = Downstream(CodecConfig(compressor="sign"), "sign")  # init="auto", the default
    start = to_state_dict(ds.start_model(to_record(adapters)))
    a_key = "model.layers.0.self_attn.q_proj.lora_A.weight"
    assert not torch.equal(start[a_key], adapters[a_key])  # drawn from the seed, same distribution
    assert float(start[a_key].abs().max()) <= 1 / math.sqrt(32)
    assert all(torch.equal(start[k], torch.zeros_like(t)) for k, t in adapters.items() if "lora_B" in k)
    rebuilt, sent, kind, _ = _first_contact(ds, to_record(start))
    assert kind == "init" and sent == 8 * len(adapters)  # one 8-byte rule per tensor
    assert all(torch.equal(rebuilt[k], start[k]) for k in start)


def test_auto_gives_other_models_a_compressed_int8_start_that_catch_ups_correct():
    trained = _adapters(b_zero=False)  # adapters that are not at peft's init (e.g. a resumed run)
    ds = Downstream(CodecConfig(compressor="sign"), "sign")
    start = ds.start_model(to_record(trained))
    assert start is not None and to_state_dict(start).keys() == trained.keys()
    assert all(torch.equal(to_state_dict(start)[k], t) for k, t in trained.items())  # nothing replaced
    rebuilt, sent, kind, _ = _first_contact(ds, to_record(trained))
    dense = sum(t.numel() * 4 for t in trained.values())
    assert kind == "init" and dense / 4.5 < sent < dense / 3.5
    top = max(float(t.abs().max()) for t in trained.values())  # blocks of 256 span tensors (one flat vector)
    for k, t in trained.items():  # int8 with stochastic rounding: within one step of a block's scale
        assert float((rebuilt[k] - t).abs().max()) <= top / 127 + 1e-7, k


def test_bad_first_contact_settings_are_refused_naming_the_setting():
    with pytest.raises(ValueError, match="downstream init"):
        Downstream(CodecConfig(), "stc", init="zip")
    with pytest.raises(ValueError, match="downstream init cannot be 'powersgd'"):
        Downstream(CodecConfig(), "stc", init="powersgd")
    with pytest.raises(ValueError, match="downstream density"):
        Downstream(CodecConfig(), "stc", density=1.5)


def test_the_app_seeds_its_model_trained_from_scratch_but_not_a_resumed_one():
    from fedcomp.app.server_app import concern_options
    from fedcomp.app.config import AppConfig

    fresh = concern_options(AppConfig.from_run_config({"downstream": "stc"}))
    resumed = concern_options(AppConfig.from_run_config({"downstream": "stc", "resume": True}))
    chosen = concern_options(AppConfig.from_run_config({"downstream": "stc", "downstream-init": "fp16"}))
    assert ((fresh["downstream"].init, resumed["downstream"].init, chosen["downstream"].init)
            == ("seeded", "auto", "fp16"))


def test_preset_lora_sets_sign_both_ways_and_the_seeded_start():
    from flwr.serverapp.strategy import FedAvg

    from fedcomp.strategies import CompressedStrategy

    s = CompressedStrategy(FedAvg(), preset="lora")
    assert (s.codec.compressor, s.codec.error_feedback, s.downstream.compressor, s.downstream.init) == \
        ("sign", True, "sign", "auto")
    start = to_state_dict(s.downstream.start_model(to_record(_adapters())))
    _, sent, kind, _ = _first_contact(s.downstream, to_record(start))
    assert kind == "init" and sent == 8 * len(start)


def test_preset_conflicts_and_inner_strategies_that_cannot_take_it_are_refused_naming_the_setting():
    from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping, FedAvg

    from fedcomp.strategies import CompressedStrategy

    with pytest.raises(ValueError, match="unknown preset 'qlora'"):
        CompressedStrategy(FedAvg(), preset="qlora")
    with pytest.raises(ValueError, match="preset 'lora' sets compressor = 'sign', but compressor = 'topk'"):
        CompressedStrategy(FedAvg(), preset="lora", compressor="topk")
    with pytest.raises(ValueError, match="preset 'lora' sets compressor = 'sign', but compressor = 'stc'"):
        CompressedStrategy(FedAvg(), preset="lora", compressor="stc")  # the old default, passed explicitly
    assert CompressedStrategy(FedAvg()).codec.compressor == "stc"  # no preset: the default
    with pytest.raises(ValueError, match="preset 'lora' keeps error feedback"):
        CompressedStrategy(DifferentialPrivacyClientSideFixedClipping(FedAvg(), noise_multiplier=1.0,
                                                                     clipping_norm=1.0, num_sampled_clients=2),
                           preset="lora")


@pytest.mark.parametrize("run_config,expected", [
    ({}, ("stc", 0.05)),  # the default federation: both ways
    ({"downstream-density": 0.02}, ("stc", 0.02)),
    ({"compressor": "none"}, ("none", 0.0)),  # fp32 stays fp32 both ways
    ({"downstream": "fp16"}, ("fp16", 0.0)),
    ({"downstream": "none"}, ("none", 0.0)),
])
def test_downstream_auto_compresses_both_ways_by_default(run_config, expected):
    from fedcomp.app.config import AppConfig

    cfg = AppConfig.from_run_config(run_config)
    assert (cfg.downstream, cfg.downstream_density) == expected


def test_downstream_under_secagg_auto_is_int8_and_an_explicit_codec_is_kept():
    """SecAgg+ hides each update, not the global model: the model rides the download there too."""
    from fedcomp.app.config import AppConfig
    from fedcomp.config.secagg import check_codec_under_secagg as check_secagg_config

    base = {"secagg": True, "compressor": "randomk", "density": 0.05, "error-feedback": False}
    assert AppConfig.from_run_config(base).downstream == "int8"
    assert AppConfig.from_run_config({**base, "downstream": "sign"}).downstream == "sign"
    check_secagg_config({**base, "downstream": "auto"})
    check_secagg_config({**base, "downstream": "stc"})
    with pytest.raises(ValueError, match="'downstream-correction' = 'on' is not supported with secagg = true"):
        check_secagg_config({**base, "downstream": "stc", "downstream-correction": "on"})


def test_the_seeded_start_differs_with_the_initial_model_and_is_reproducible():
    """The draw's seed comes from the initial model: two runs seeded alike start alike, runs with
    another initialisation (another run seed) start elsewhere."""
    def start(torch_seed):
        torch.manual_seed(torch_seed)
        sd = nn.Linear(20, 10).state_dict()
        return to_state_dict(Downstream(CodecConfig(), "stc", init="seeded").start_model(to_record(sd)))["weight"]

    assert torch.equal(start(1), start(1)) and not torch.equal(start(1), start(2))


class _Cnn(nn.Module):
    """Conv and Linear layers at PyTorch's default initialisation, a BatchNorm and a small bias."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 32, 3)
        self.bn = nn.BatchNorm2d(32)
        self.fc = nn.Linear(1152, 64)
        self.out = nn.Linear(64, 10)


def _floats(sd) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy() for k, v in sd.items() if v.is_floating_point()}


def test_auto_seeds_a_model_at_pytorchs_default_initialisation_and_sends_its_small_tensors_exactly():
    from fedcomp.download.first_contact import MIN_SEEDED_NUMEL, pytorch_default_init

    torch.manual_seed(0)
    sd = _Cnn().state_dict()
    ds = Downstream(CodecConfig(compressor="sign"), "sign")  # init="auto"
    start = to_state_dict(ds.start_model(to_record(sd)))
    drawn = [k for k, t in sd.items() if t.is_floating_point() and t.dim() >= 2 and t.numel() >= MIN_SEEDED_NUMEL]
    assert drawn == ["conv.weight", "fc.weight", "out.weight"]
    for k, t in sd.items():
        if k in drawn:  # another draw of the same distribution, within PyTorch's bound 1/sqrt(fan_in)
            bound = 1 / math.sqrt(math.prod(t.shape[1:]))
            assert not torch.equal(start[k], t) and float(start[k].abs().max()) <= bound * 1.001
            assert abs(float(start[k].std()) / float(t.std()) - 1) < 0.1
        else:  # biases, BatchNorm's constants and its integer counter: unchanged
            assert torch.equal(start[k], t), k
    rebuilt, sent, kind, _ = _first_contact(ds, to_record(start))
    assert kind == "init" and all(torch.equal(rebuilt[k], start[k]) for k in start)
    dense = sum(t.numel() * t.element_size() for t in sd.values())
    assert sent < dense / 10  # the biases and the BatchNorm tensors travel, the weights as 8-byte rules
    assert pytorch_default_init(_floats(sd), 1).exact == {"conv.bias", "fc.bias", "out.bias"}


def _trained_one_step(model: nn.Module) -> nn.Module:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 1, 8, 8)
    loss = model.fc(torch.relu(model.bn(model.conv(x))).flatten(1)).square().mean()
    loss.backward()
    opt.step()
    return model


@pytest.mark.parametrize("change", ["one SGD step", "xavier", "normal", "tied", "batchnorm ran", "pruned", "halved",
                                    "truncated normal", "narrower uniform", "bias trained", "lstm"])
def test_auto_keeps_a_model_that_is_not_at_pytorchs_default_initialisation(change):
    """A trained (even for one step), otherwise initialised, pruned, rescaled or tied model, or BatchNorm
    statistics that moved: the int8 start, the model's own values (redrawing them would throw training, a
    mask or a tie away)."""
    from fedcomp.download.first_contact import pytorch_default_init

    torch.manual_seed(1)
    model = _Cnn()
    if change == "one SGD step":
        _trained_one_step(model)
    elif change == "xavier":
        nn.init.xavier_uniform_(model.fc.weight)
    elif change == "normal":
        nn.init.normal_(model.fc.weight, std=0.02)
    elif change == "pruned":  # a mask at initialisation (a lottery-ticket start): zeros no uniform draw has
        with torch.no_grad():
            model.fc.weight[:, ::10] = 0.0
    elif change == "halved":
        with torch.no_grad():
            model.fc.weight.mul_(0.5)
    elif change == "truncated normal":  # reaches the bound, but not with a uniform's spread
        nn.init.trunc_normal_(model.fc.weight, std=0.5 / math.sqrt(1152), a=-1 / math.sqrt(1152), b=1 / math.sqrt(1152))
    elif change == "narrower uniform":
        nn.init.uniform_(model.fc.weight, -0.95 / math.sqrt(1152), 0.95 / math.sqrt(1152))
    elif change == "bias trained":  # only the biases moved: past their layer's bound
        with torch.no_grad():
            model.out.bias.add_(0.5)
    elif change == "lstm":  # uniform in 1/sqrt(hidden_size), not 1/sqrt(input_size): another distribution
        model.rnn = nn.LSTM(100, 110)
    elif change == "tied":
        model.extra = nn.Linear(1152, 64)
        model.extra.weight = model.fc.weight
    else:
        model.bn(torch.randn(4, 32, 6, 6))
    assert pytorch_default_init(_floats(model.state_dict()), 1) is None
    ds = Downstream(CodecConfig(compressor="sign"), "sign")
    start = to_state_dict(ds.start_model(to_record(model.state_dict())))
    assert all(torch.equal(start[k], t) for k, t in model.state_dict().items())  # nothing replaced
    assert ds.init == "int8"


def test_auto_seeds_a_half_precision_model_at_its_initialisation():
    from fedcomp.download.first_contact import pytorch_default_init

    torch.manual_seed(2)
    assert pytorch_default_init(_floats(_Cnn().half().state_dict()), 1) is not None
