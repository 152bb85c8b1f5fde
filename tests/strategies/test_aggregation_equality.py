"""The streaming aggregation (one running sum, O(model) memory) gives the dense path's results.

Each federation runs 20 rounds of the in-process grid with the streaming strategy; every round, a
twin strategy with ``aggregation = "dense"`` (today's path: every reply decoded to dense weights
and handed to the inner strategy) aggregates deep copies of the same replies, and the two results
must agree to fp32 rounding: max |streaming - dense| <= 1e-6 x max |dense| per tensor. A last test
runs two complete, independent 20-round federations and compares their final weights.
"""

import copy
import logging

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedcomp.app.client_app import app as client_app
from fedcomp.app.config import AppConfig
from fedcomp.task.models import build_model
from fedcomp.app.server_app import build_inner, concern_options
from fedcomp.run.inprocess_grid import InProcessGrid
from fedcomp.strategies import CompressedStrategy

logging.getLogger("flwr").setLevel(logging.WARNING)
ROUNDS = 20


def _strategy(cfg, aggregation):
    return CompressedStrategy.from_codec_config(build_inner(cfg), cfg.codec, aggregation=aggregation,
                                                **concern_options(cfg))


def _rel_diff(a: ArrayRecord, b: ArrayRecord) -> float:
    worst = 0.0
    for k in b:
        x, y = a[k].numpy().astype(np.float64), b[k].numpy().astype(np.float64)
        assert a[k].numpy().dtype == b[k].numpy().dtype and x.shape == y.shape, k
        scale = max(float(np.abs(y).max()), 1e-12) if y.size else 1.0
        worst = max(worst, float(np.abs(x - y).max()) / scale if y.size else 0.0)
    return worst


def _lockstep(run_config: dict, nodes: int = 2) -> tuple[list[float], CompressedStrategy]:
    cfg = AppConfig.from_run_config(run_config)
    torch.manual_seed(cfg.seed)
    streaming, dense = _strategy(cfg, "auto"), _strategy(cfg, "dense")
    for s in (streaming, dense):  # the ServerApp's DP noise comes from the OS CSPRNG: pin it for the twins
        if s.client_dp is not None:
            s.client_dp._gen = torch.Generator().manual_seed(cfg.seed)
    diffs: list[float] = []
    orig = streaming.aggregate_train

    def twin(rnd, replies):
        replies = list(replies)
        dense.remember(rnd, streaming.sent_round.model, streaming.sent_round.sampled)
        want, want_m = dense.aggregate_train(rnd, copy.deepcopy(replies))
        got, got_m = orig(rnd, replies)
        assert (want is None) == (got is None)
        if got is not None:
            diffs.append(_rel_diff(got, want))
        want_all = {**dict(want_m or {}), **dense.history.get(rnd, {})}  # Flower's record + the round's own
        got_all = {**dict(got_m or {}), **streaming.history.get(rnd, {})}
        for key in ("num-replies", "rejected-replies", "failed-clients", "upload-bytes", "train-loss"):
            if want_all.get(key) is None:
                assert got_all.get(key) is None, key
            else:
                assert got_all.get(key) == pytest.approx(want_all.get(key), rel=1e-9), key
        return got, got_m

    orig_configure = streaming.configure_train

    def configure_both(rnd, arrays, config, grid):
        list(dense.configure_train(rnd, arrays, ConfigRecord(dict(config)), grid))  # the twin's optimizer state
        return orig_configure(rnd, arrays, config, grid)

    streaming.aggregate_train = twin
    streaming.configure_train = configure_both
    grid = InProcessGrid(client_app, nodes, run_config)
    streaming.start(grid=grid, initial_arrays=ArrayRecord(build_model(cfg.model).state_dict()), num_rounds=ROUNDS,
                    train_config=ConfigRecord({"seed": cfg.seed}))
    return diffs, streaming


# downstream "none": a compressed download selects entries of (global - broadcast), so the fp32 rounding
# differences compared here could flip a selection and grow; the two folds are compared on the upload
BASE = {"num-server-rounds": ROUNDS, "lr": 0.1, "seed": 5, "batch-size": 256, "downstream": "none"}


@pytest.mark.parametrize("codec,extra", [
    ("none", {}), ("fp16", {}), ("bf16", {}), ("sign", {}), ("stc", {"density": 0.01}), ("topk", {"density": 0.01}),
    ("randomk", {"density": 0.1}), ("qsgd", {}), ("int8", {}), ("stc", {"density": 0.01, "selection": "tensor"}),
])
def test_streaming_equals_dense_fedavg_every_codec(codec, extra):
    diffs, s = _lockstep({**BASE, "compressor": codec, **extra})
    assert len(diffs) == ROUNDS
    assert max(diffs) <= 1e-6, diffs


@pytest.mark.parametrize("strategy", ["fedavgm", "fedadam"])
@pytest.mark.parametrize("codec", ["stc"])
def test_streaming_equals_dense_server_optimizers(strategy, codec):
    diffs, _ = _lockstep({**BASE, "compressor": codec, "strategy": strategy, "server-lr": 0.5 if strategy == "fedavgm"
                          else 0.01})
    assert len(diffs) == ROUNDS and max(diffs) <= 1e-6, diffs


def test_streaming_equals_dense_with_client_level_dp_and_a_fixed_seed():
    diffs, s = _lockstep({**BASE, "compressor": "topk", "density": 0.05, "dp": "client-level",
                          "noise-multiplier": 0.3, "clipping-norm": 0.5})
    assert len(diffs) == ROUNDS and max(diffs) <= 1e-6, diffs


def test_two_independent_federations_end_within_fp32_rounding():
    """Streaming vs dense over 20 rounds, run separately: differences of fp32 rounding stay small."""
    out = {}
    for aggregation in ("auto", "dense"):
        cfg = AppConfig.from_run_config({**BASE, "compressor": "stc"})
        torch.manual_seed(cfg.seed)
        res = _strategy(cfg, aggregation).start(grid=InProcessGrid(client_app, 2, {**BASE, "compressor": "stc"}),
                                                 initial_arrays=ArrayRecord(build_model().state_dict()),
                                                 num_rounds=ROUNDS, train_config=ConfigRecord({"seed": cfg.seed}))
        out[aggregation] = res.arrays
    assert _rel_diff(out["auto"], out["dense"]) <= 1e-5
