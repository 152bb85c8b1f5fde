"""The downstream correction (:mod:`fedcomp.download.correction`): each client's update is
counted from the global model G rather than from the compressed copy H_i it trained from."""

import logging

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import FedAvg

from fedcomp.app.client_app import app as client_app
from fedcomp.run.inprocess_grid import InProcessGrid
from fedcomp.statedict import FlatModel
from fedcomp.strategies import CompressedStrategy, Download, Privacy
from fedcomp.strategies.aggregate import ClippedFold, MeanFold
from fedcomp.download.correction import correct_for_copies
from fedcomp.task.models import build_model

logging.getLogger("flwr").setLevel(logging.WARNING)


def _model() -> FlatModel:
    return FlatModel({"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([0.5, -0.5], np.float32),
                      "n": np.array(7, np.int64)}, {"w": "float32", "b": "float32", "n": "int64"})


def test_each_update_is_folded_from_the_global_model():
    """sum_i w_i delta_i gains c * w * (H - G) for every copy H held by clients of total weight w; the
    integer tensors are left alone; c = 0 changes nothing."""
    g = _model()
    fold = MeanFold(g)
    fold.weights = {1: 2.0, 2: 3.0, 3: 5.0}
    g_vec = np.concatenate([g.float_view("w").ravel(), g.float_view("b")])
    copies = [(g_vec + 1.0, 2.0), (g_vec - np.arange(8, dtype=np.float32), 3.0)]
    done = correct_for_copies(fold, ["w", "b"], g, copies, 0.5)
    assert done == 2
    want = 0.5 * (2.0 * 1.0 + 3.0 * -np.arange(8, dtype=np.float64))
    assert np.array_equal(np.concatenate([fold.running.acc["w"], fold.running.acc["b"]]), want)
    assert fold.running.total == 0 and fold.running.count == 0  # weights come from the replies, not from here
    before = {k: v.copy() for k, v in fold.running.acc.items()}
    assert correct_for_copies(fold, ["w", "b"], g, copies, 0.0) == 0
    assert all(np.array_equal(before[k], fold.running.acc[k]) for k in before)


def test_folds_without_per_client_weights_are_left_alone():
    """Client-level DP's clipped sum has no per-client weights: nothing is added to it."""
    g = _model()

    class _DP:  # ClippedFold needs only the clip factor here
        clipping_norm = 1.0

    fold = ClippedFold(g, _DP())
    assert correct_for_copies(fold, ["w", "b"], g, [(np.zeros(8, np.float32), 1.0)], 1.0) == 0
    assert not fold.running.flat().any()


@pytest.mark.parametrize("codec, optimizer, want", [("stc", "adamw", 1.0), ("topk", "adamw", 1.0),
                                                    ("randomk", "adamw", 1.0), ("stc", "sgd", 0.0),
                                                    ("sign", "adamw", 0.0), ("int8", "adamw", 0.0),
                                                    ("none", "adamw", 0.0)])
def test_the_apps_auto_is_on_for_adamw_with_a_sparse_download(codec, optimizer, want):
    """Measured: on for the AdamW Transformer with STC downward (+3 points at round 20), off for SGD (the
    default CNN: 1.4 points lower with it) and for sign downward (LoRA: less of the gain kept)."""
    from fedcomp.app.server_app import concern_options
    from fedcomp.app.config import AppConfig
    from fedcomp.app.resolve import resolve_correction

    assert resolve_correction("auto", codec, optimizer) == want
    assert resolve_correction("on", codec, optimizer) == 1.0 and resolve_correction("off", codec, optimizer) == 0.0
    if codec != "none":
        cfg = AppConfig.from_run_config({"downstream": codec, "optimizer": optimizer, "compressor": "stc"})
        assert concern_options(cfg)["downstream"].correction == want


def test_the_strategy_default_is_off():
    assert CompressedStrategy(FedAvg(), compressor="stc", downstream="stc").downstream.correction == 0.0


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "auto", True, None])
@pytest.mark.parametrize("downstream", ["stc", "none"])
def test_a_bad_correction_is_refused_naming_the_setting(bad, downstream):
    with pytest.raises(ValueError, match="downstream correction"):
        CompressedStrategy(FedAvg(), compressor="stc", downstream=Download(downstream, correction=bad))


def test_a_numpy_number_is_a_number():
    s = CompressedStrategy(FedAvg(), compressor="stc", downstream=Download("stc", correction=np.float32(0.5)))
    assert s.downstream.correction == 0.5


def test_a_correction_that_cannot_apply_is_refused_naming_why():
    """Before, these were accepted and silently did nothing."""
    from flwr.serverapp.strategy import FedMedian

    from fedcomp.privacy import ClientLevelDP

    cases = [("none", {}, "the download is dense"),
             ("stc", {"privacy": Privacy(client_dp=ClientLevelDP(1.0, 1.0, 1e-5))}, "client-level DP"),
             ("stc", {"error_feedback": "ef21"}, "EF21"),
             ("stc", {"aggregation": "dense"}, "aggregation = 'dense'")]
    for codec, kwargs, why in cases:
        with pytest.raises(ValueError, match=f"downstream correction = 1.0 cannot apply: .*{why}"):
            CompressedStrategy(FedAvg(), compressor="stc", downstream=Download(codec, correction=1.0), **kwargs)
    with pytest.raises(ValueError, match="every client's weights"):
        CompressedStrategy(FedMedian(), compressor="stc", downstream=Download("stc", correction=1.0))
    assert CompressedStrategy(FedMedian(), compressor="stc", downstream="stc").downstream.correction == 0.0


def test_the_apps_auto_is_off_where_the_strategy_cannot_apply_it():
    from fedcomp.app.resolve import resolve_correction

    assert resolve_correction("auto", "stc", "adamw", dp="client-level") == 0.0
    assert resolve_correction("auto", "stc", "adamw", error_feedback="ef21") == 0.0
    assert resolve_correction("auto", "stc", "adamw", dp="local") == 1.0


def test_a_bad_run_config_value_is_refused_naming_the_key():
    from fedcomp.app.config import AppConfig

    with pytest.raises(ValueError, match="downstream-correction"):
        AppConfig.from_run_config({"downstream-correction": "yes"})


def _one_round(correction: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Round 1 of two clients (every client in the round, so both hold the broadcast start B_1):
    the global model sent, what the clients held, and the new global model (float tensors, flat)."""
    torch.manual_seed(0)
    start = ArrayRecord(build_model().state_dict())
    grid = InProcessGrid(client_app, 2, {"lr": 0.1, "seed": 1})
    s = CompressedStrategy(FedAvg(min_available_nodes=2, fraction_evaluate=0.0), compressor="stc", density=0.05,
                           downstream=Download("stc", init="int8", correction=correction))
    msgs = list(s.configure_train(1, start, ConfigRecord({"seed": 1}), grid))
    arrays, _ = s.aggregate_train(1, grid.send_and_receive(msgs))
    held = {m.metadata.dst_node_id: s.downstream.held(m.metadata.dst_node_id) for m in msgs}
    a, b = held.values()
    assert np.array_equal(a, b)  # both trained from the int8 start B_1, not from G
    flat = lambda rec: np.concatenate([rec[k].numpy().ravel() for k in rec if rec[k].numpy().dtype.kind == "f"])
    return flat(start), a, flat(arrays)


def test_with_every_client_on_the_broadcast_c_1_is_fedavg_of_the_client_models():
    """Every client trained from B_1 (the int8 start), not from G: with c = 1 the new global model is
    B_1 + mean(delta), the weighted mean of the models the clients computed; with c = 0 it is
    G + mean(delta). Their difference is exactly B_1 - G (float32 rounding of the two sums)."""
    g, b1, off = _one_round(0.0)
    g_, b1_, on = _one_round(1.0)
    assert np.array_equal(g, g_) and np.array_equal(b1, b1_)  # the same start, the same copies
    assert np.abs(b1 - g).max() > 1e-3  # the int8 start left something out
    np.testing.assert_allclose(on - off, b1 - g, rtol=0, atol=2e-6)


def test_the_sender_corrects_from_the_copies_the_clients_hold_even_when_forgotten_in_the_round():
    """Under partial participation clients hold different broadcast versions or private catch-up copies,
    and a tight copy budget forgets some of them while the round's other replies are committed. The
    folded correction equals sum_i w_i (H_i - G) over every replying client, with H_i the copy the
    client itself rebuilt and trained from (not the server's record of it), one pass per broadcast
    version held and per private copy.
    Before, a client forgotten between its own reply and the correction was folded uncorrected."""
    from tests.download.test_node_copies import SHAPES, Fed, _walk

    init, seq = _walk(rounds=8)
    fed = Fed("stc", 8, init=init, density=0.05)
    fed.ds.correction = 1.0
    fed.ds.nodes.max_copies = 3.0
    rng = np.random.default_rng(3)
    for w in seq[:-1]:
        fed.round(w, sorted(rng.choice(8, 3, replace=False).tolist()))
    got = fed.round(seq[-1], list(range(8)), reply=False)  # every node: new, lagging (diffs), in sync
    g_model = FlatModel({k: v.copy() for k, v in seq[-1].items()}, dict.fromkeys(SHAPES, "float32"))
    g = np.concatenate([seq[-1][k].ravel() for k in SHAPES]).astype(np.float64)
    fold = MeanFold(g_model)
    fold.weights = {n: float(n + 1) for n in range(8)}
    stats = [{"node": n, "download-bytes": -1.0} for n in range(8)]
    groups = fed.ds.note_replies(stats, fold, g_model)
    assert all(st["download-bytes"] == fed.ds.sent_bytes[st["node"]] > 0 for st in stats)
    forgotten = [n for n in range(8) if fed.ds.nodes.held(n) is None]
    assert forgotten  # the budget forgot some of this round's repliers before the round ended
    held = {n: np.concatenate([rec[k].numpy().ravel() for k in SHAPES]) for n, rec in got.items()}
    assert len(held) == 8 and 1 <= groups <= 8  # at most one pass per client
    want = sum(fold.weights[n] * (h.astype(np.float64) - g) for n, h in held.items())
    got_sum = np.concatenate([fold.running.acc[k] for k in SHAPES])
    np.testing.assert_allclose(got_sum, want, rtol=1e-12, atol=1e-9)


def test_the_correction_holds_no_more_private_copies_than_the_budget_whatever_the_clients():
    """At ResNet-18 size with 1,000 nodes and 100 new or lagging clients a round, each with a private
    copy, the correction used to keep every replier's copy referenced until the end of the round
    (benchmarks/scale.py --corrections 0,1: +5x the model's bytes at the aggregation's peak with 10
    repliers; one more copy per replier). Now each private copy is folded as its node is committed:
    while the round's replies are committed, at most the budget's copies plus the one being folded are
    alive, and the correction is the same."""
    import gc
    import weakref

    from tests.download.test_node_copies import SHAPES, Fed, _walk

    init, seq = _walk(rounds=6)
    fed = Fed("stc", 24, init=init, density=0.05)
    fed.ds.correction = 1.0
    fed.ds.nodes.max_copies = 3.0
    for i, w in enumerate(seq[:-1]):  # every node seen, then lagging: the last round's repliers get private diffs
        fed.round(w, list(range(24)) if i == 0 else [i])
    got = fed.round(seq[-1], list(range(24)), reply=False)
    g_model = FlatModel({k: v.copy() for k, v in seq[-1].items()}, dict.fromkeys(SHAPES, "float32"))
    fold = MeanFold(g_model)
    fold.weights = {n: 1.0 for n in range(24)}
    alive, most = [], 0
    commit = fed.ds.nodes.commit

    def counting_commit(node, rebuild, verify=None):
        nonlocal most
        commit(node, rebuild, verify)
        if node in fed.ds.nodes.private:
            alive.append(weakref.ref(fed.ds.nodes.private[node]))
        gc.collect()
        most = max(most, sum(r() is not None for r in alive))

    fed.ds.nodes.commit = counting_commit
    fed.ds.note_replies([{"node": n} for n in range(24)], fold, g_model)
    assert len(alive) >= 20  # the lagging nodes each rebuilt a private copy
    assert most <= 3 + 1  # was 24: every replier's copy held until the round's correction
    g = np.concatenate([seq[-1][k].ravel() for k in SHAPES]).astype(np.float64)
    want = sum(np.concatenate([rec[k].numpy().ravel() for k in SHAPES]).astype(np.float64) - g for rec in got.values())
    np.testing.assert_allclose(np.concatenate([fold.running.acc[k] for k in SHAPES]), want, rtol=1e-12, atol=1e-9)


def test_a_fold_without_the_global_model_is_refused_and_commits_nothing():
    """note_replies with a correction and a fold but no ``sent`` names what is missing (was an
    AttributeError deep in the fold) before committing any reply."""
    from tests.download.test_node_copies import SHAPES, Fed, _walk

    init, seq = _walk(rounds=2)
    fed = Fed("stc", 2, init=init, density=0.05)
    fed.ds.correction = 1.0
    fed.round(seq[0], [0, 1])
    fed.round(seq[1], [0, 1], reply=False)
    fold = MeanFold(FlatModel({k: v.copy() for k, v in seq[1].items()}, dict.fromkeys(SHAPES, "float32")))
    fold.weights = {0: 1.0, 1: 1.0}
    pending = dict(fed.ds.nodes.pending)
    with pytest.raises(ValueError, match="needs the round's global model"):
        fed.ds.note_replies([{"node": 0}, {"node": 1}], fold, None)
    assert fed.ds.nodes.pending == pending and len(pending) == 2


@pytest.mark.parametrize("extra, why", [({"error-feedback": "ef21"}, "EF21"),
                                        ({"dp": "client-level", "clipping-norm": 1.0, "noise-multiplier": 1.0},
                                         "client-level DP"),
                                        ({"compressor": "none"}, "the download is dense")])
def test_the_run_config_on_where_it_cannot_apply_is_one_error_naming_the_key(extra, why):
    """Found by a new user: these combinations passed the config stage and failed in the strategy's
    constructor, a traceback naming the Python argument (exit code 700) instead of the run-config key."""
    from fedcomp.app.server_app import concern_options
    from fedcomp.app.config import AppConfig

    with pytest.raises(ValueError, match=f"run config 'downstream-correction' = 'on' cannot apply: .*{why}"):
        concern_options(AppConfig.from_run_config({"downstream-correction": "on", **extra}))


def test_secure_aggregation_refuses_the_correction():
    """The secure path sends the model dense (no copies to correct): 'on' was silently ignored there."""
    from fedcomp.app.secagg_server_app import check_secagg_config

    with pytest.raises(ValueError, match="'downstream-correction' = 'on' is not supported with secagg"):
        check_secagg_config({"secagg": True, "downstream-correction": "on"})
    check_secagg_config({"secagg": True, "downstream-correction": "auto"})
    check_secagg_config({"secagg": True, "downstream-correction": "off"})


def test_numpy_numbers_are_numbers_for_every_download_setting():
    """Found by a new user: the correction took np.float32 / np.int64 but the download's density
    and max_copies refused them ("must be in (0, 1], got np.float32(0.05)")."""
    s = CompressedStrategy(FedAvg(), compressor="stc",
                           downstream=Download("stc", density=np.float32(0.05), max_copies=np.int64(2),
                                               correction=np.float32(1.0)))
    assert s.downstream.density == pytest.approx(0.05) and s.downstream.correction == 1.0
    assert s.downstream.nodes.max_copies == 2.0 and type(s.downstream.nodes.max_copies) is float
    for bad in (np.float32("nan"), np.float32(1.5), np.int64(0)):
        with pytest.raises(ValueError, match="downstream density must be in"):
            CompressedStrategy(FedAvg(), compressor="stc", downstream=Download("stc", density=bad))
    with pytest.raises(ValueError, match="downstream max_copies must be a finite number >= 2"):
        CompressedStrategy(FedAvg(), compressor="stc", downstream=Download("stc", max_copies=np.int64(1)))
