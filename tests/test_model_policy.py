"""``batchnorm-affine = "small"``: BatchNorm's affine parameters skip the sparse codecs, said once
in the log; off by default (measured: it did not pay for its bytes on ``model = "resnet"``)."""

import logging

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import FedAvg

from fedcomp.client.update import compress_update, plan_units
from fedcomp.config import CodecConfig
from fedcomp.config.model_policy import batchnorm_affine_keys, describe
from fedcomp.task.models import build_model
from fedcomp.protocol.messages import MODEL_KEY
from fedcomp.strategies import CompressedStrategy

RESNET = {k: tuple(v.shape) for k, v in build_model("resnet").state_dict().items() if v.is_floating_point()}


def test_affine_keys_are_those_of_modules_with_running_statistics():
    keys = batchnorm_affine_keys(RESNET)
    assert len(keys) == 18 and sum(int(np.prod(RESNET[k])) for k in keys) == 672
    assert {"bn1.weight", "bn1.bias", "layer2.shortcut.1.weight", "layer3.bn2.bias"} <= set(keys)
    assert not {"conv1.weight", "fc.weight", "fc.bias", "layer2.shortcut.0.weight"} & set(keys)
    assert batchnorm_affine_keys(build_model("cnn").state_dict()) == []
    # LayerNorm has weight/bias but no running statistics: not BatchNorm
    assert batchnorm_affine_keys(["ln.weight", "ln.bias", "bn.weight", "bn.running_var"]) == ["bn.weight"]


@pytest.mark.parametrize("codec", ["stc", "topk", "randomk"])
def test_sparse_codecs_send_batchnorm_affine_parameters_with_the_small_tensor_codec(codec):
    units = {k: (m, c) for k, m, c in plan_units(RESNET, CodecConfig(compressor=codec, density=0.01,
                                                                      batchnorm_affine="small"))}
    assert units["bn1.weight"] == (["bn1.weight"], "none") and units["layer3.bn2.bias"] == (["layer3.bn2.bias"], "none")
    model_members = units[MODEL_KEY][0]
    assert "conv1.weight" in model_members and "fc.bias" in model_members and "bn1.weight" not in model_members
    plain = {k: c for k, _, c in plan_units(RESNET, CodecConfig(compressor=codec))}
    assert "bn1.weight" not in plain  # the default: inside the whole-model payload


def test_dense_and_per_tensor_codecs_are_unchanged():
    units = {k: c for k, _, c in plan_units(RESNET, CodecConfig(compressor="sign", batchnorm_affine="small",
                                                                batchnorm_stats="small"))}
    assert units["bn1.weight"] == "sign" and units["bn1.running_var"] == "none"
    cnn = {k: tuple(v.shape) for k, v in build_model("cnn").state_dict().items()}
    assert plan_units(cnn, CodecConfig(compressor="stc", batchnorm_affine="small")) == [(MODEL_KEY, list(cnn), "stc")]


def test_affine_updates_arrive_exactly():
    rng = np.random.default_rng(0)
    g = {k: rng.standard_normal(s).astype(np.float32) for k, s in RESNET.items()}
    t = {k: v + np.float32(0.01) * rng.standard_normal(v.shape).astype(np.float32) for k, v in g.items()}
    _, _, stats = compress_update(g, t, CodecConfig(compressor="stc", density=0.01, batchnorm_affine="small"), {})
    errs = dict(zip(RESNET, stats["layer-compression-error"]))
    assert errs["bn1.weight"] == 0.0 and errs["layer3.shortcut.1.bias"] == 0.0
    assert errs["layer3.conv2.weight"] > 0.5


def test_the_server_says_once_what_the_model_decided(caplog):
    sd = build_model("resnet").state_dict()
    small = CodecConfig(batchnorm_affine="small")
    line = describe(sd.keys(), {k: v.numel() for k, v in sd.items()}, small)
    assert line == ("fedcomp: the model has 9 BatchNorm layers: their 18 affine parameters (672 entries) travel with "
                    "small-tensor-compressor 'none' instead of 'stc' (batchnorm-affine = \"small\"; \"codec\" turns "
                    "this off)")
    assert describe(sd.keys(), {k: v.numel() for k, v in sd.items()}, CodecConfig()) is None  # default: off
    assert describe(sd.keys(), {k: v.numel() for k, v in sd.items()},
                    CodecConfig(compressor="sign", batchnorm_affine="small")) is None
    assert describe(build_model("cnn").state_dict().keys(), {}, small) is None
    from fedcomp.app.client_app import app as client_app
    from fedcomp.run.inprocess_grid import InProcessGrid

    s = CompressedStrategy(FedAvg(min_available_nodes=2), compressor="stc", batchnorm_affine="small")
    grid = InProcessGrid(client_app, 2, {})
    with caplog.at_level(logging.INFO, logger="flwr"):
        for rnd in (1, 2):
            s.configure_train(rnd, ArrayRecord(sd), ConfigRecord(), grid)
    assert caplog.text.count("9 BatchNorm layers") == 1


def test_config_key_is_validated():
    assert CodecConfig.from_mapping({}).batchnorm_affine == "codec"
    assert CodecConfig.from_mapping({"batchnorm-affine": "small"}).batchnorm_affine == "small"
    with pytest.raises(ValueError, match="'batchnorm-affine' must be one of"):
        CodecConfig.from_mapping({"batchnorm-affine": "dense"})
