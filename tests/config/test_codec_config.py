"""Run-config keys of the new codecs and options: defaults, validation naming the key, build()."""

import pytest
import torch

from fedcomp.task.training import TrainConfig, train
from fedcomp.app.config import AppConfig
from fedcomp.config import CodecConfig


def test_defaults():
    c = CodecConfig.from_mapping({})
    assert (c.rank, c.unbiased, c.spacing, c.momentum_correction) == (4, False, "uniform", 0.0)
    assert AppConfig.from_run_config({}).local_clip_norm == 0.0


@pytest.mark.parametrize("cfg,msg", [
    ({"rank": 0}, "'rank' must be in"), ({"rank": 2.5}, "'rank' must be an integer"),
    ({"unbiased": 1}, "'unbiased' must be true or false"), ({"spacing": "log"}, "'spacing' must be one of"),
    ({"momentum-correction": 1.0}, "'momentum-correction' must be in"),
    ({"momentum-correction": -0.1}, "'momentum-correction'"),
    ({"momentum-correction": 0.9, "error-feedback": False}, "'momentum-correction' needs 'error-feedback'"),
    ({"compressor": "powersgd", "error-feedback": False}, "'error-feedback' must be true with compressor 'powersgd'"),
    ({"layer-codecs": "fc*=powersgd", "error-feedback": False}, "'error-feedback' must be true"),
    ({"compressor": "powersgd", "selection": "model"}, "'selection' must be 'tensor' or 'auto'"),
    ({"compressor": "qsgd", "spacing": "exponential", "levels": 200}, "'levels' must be in \\[1, 126\\]"),
    ({"compressor": "qsgd", "levels": 4}, "'error-feedback': qsgd with levels=4.*'levels' to 12 or more"),
    ({"layer-codecs": "fc*=qsgd", "levels": 4}, "'error-feedback': qsgd with levels=4"),
])
def test_bad_combinations_name_the_key(cfg, msg):
    with pytest.raises(ValueError, match=msg):
        CodecConfig.from_mapping(cfg)


def test_local_clip_norm_validation():
    with pytest.raises(ValueError, match="'local-clip-norm'"):
        AppConfig.from_run_config({"local-clip-norm": -1.0})
    with pytest.raises(ValueError, match="'local-clip-norm' must be 0 with dp = 'dp-sgd'"):
        AppConfig.from_run_config({"local-clip-norm": 1.0, "dp": "dp-sgd"})


def test_downstream_codecs():
    with pytest.raises(ValueError, match="'downstream' cannot be 'powersgd'"):
        AppConfig.from_run_config({"downstream": "powersgd"})
    assert AppConfig.from_run_config({"downstream": "eden"}).downstream == "eden"


def test_build_passes_the_options():
    c = CodecConfig.from_mapping({"compressor": "powersgd", "rank": 2, "value-dtype": "fp16",
                                  "small-tensor-compressor": "fp16"})
    assert c.scope == "tensor"
    p = c.build(seed=3)
    assert (p.rank, p.value_dtype, p.fallback, p.seed) == (2, "fp16", "fp16", 3)
    e = CodecConfig.from_mapping({"compressor": "eden", "unbiased": True}).build(seed=1)
    assert e.unbiased and e.seed == 1
    q = CodecConfig.from_mapping({"compressor": "qsgd", "spacing": "exponential", "levels": 7}).build(seed=0)
    assert q.spacing == "exponential" and q.levels == 7
    assert CodecConfig.from_mapping({"spacing": "exponential", "levels": 300}).compressor == "stc"  # qsgd unused
    assert "momentum correction 0.9" in CodecConfig.from_mapping({"momentum-correction": 0.9}).describe()


def test_train_config_round_trip():
    c = CodecConfig.from_mapping({"compressor": "topk", "momentum-correction": 0.5, "rank": 8, "unbiased": True})
    assert CodecConfig.from_mapping(c.to_mapping()) == c


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x)


def test_local_clip_norm_bounds_every_step(monkeypatch):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(100 * torch.randn(64, 4), torch.randint(0, 3, (64,)))
    seen = []
    model = _Tiny()
    orig = torch.optim.SGD.step

    def spy(self, *a, **k):
        seen.append(float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(p.grad) for g in self.param_groups for p in g["params"]]))))
        return orig(self, *a, **k)

    monkeypatch.setattr(torch.optim.SGD, "step", spy)
    train(model, data, TrainConfig(batch_size=8, lr=0.01, momentum=0.0, local_clip_norm=0.5), torch.device("cpu"))
    clipped = list(seen)
    seen.clear()
    train(_Tiny(), data, TrainConfig(batch_size=8, lr=0.01, momentum=0.0), torch.device("cpu"))
    assert len(clipped) == 8 and max(clipped) <= 0.5 * (1 + 1e-5)
    assert max(seen) > 5  # without clipping these steps are far larger
