"""DiLoCo (fedcomp.distributed.outer): every check runs 2-3 gloo ranks in spawned processes on 127.0.0.1."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedcomp.distributed import DiLoCo
from tests.distributed import outer_helpers as h
from tests.distributed.shaped import run_quick

REPO = Path(__file__).resolve().parents[2]


def test_h1_identity_codec_plain_sgd_outer_equals_ddp():
    ranks = h.values(h.launch(h.ddp_vs_diloco, 2, 6))
    for r in ranks:
        assert max(r["diffs"]) < 1e-6, r["diffs"]
        # per step: the fp32 allreduce of the pseudo-gradient + one float per rank for the finiteness check
        assert r["sent"] == 6 * (4 * r["numel"] + 4 * 2)
        assert r["dense"] == 6 * 4 * r["numel"]


def test_ranks_bit_identical_after_every_outer_step_for_each_codec():
    ranks = h.values(h.launch(h.identical_after_outer_steps, 3, h.CODEC_CASES, 3, 9))
    for name in h.CODEC_CASES:
        for r in ranks:
            assert r[name]["identical"] and r[name]["drifted"], (name, r[name])
            assert r[name]["checks"] == 3
        assert ranks[0][name]["error_feedback"] == (name != "none")
    assert ranks[0]["stc"]["ratio"] > 2 and ranks[0]["none"]["ratio"] > 2  # H = 3: ~3x fewer bytes than DDP


def test_streaming_fragments_stay_bit_identical():
    cases = {"stc": {"density": 0.2}, "int8": {"seed": 1}}
    ranks = h.values(h.launch(h.identical_after_outer_steps, 2, cases, 4, 12, 3))
    for name in cases:
        for r in ranks:
            # 3 fragments, each synchronised every 4 inner steps: 9 fragment synchronisations in 12 steps
            assert r[name]["identical"] and r[name]["drifted"] and r[name]["checks"] == 9, r[name]


@pytest.mark.parametrize("overlap", [0, 1])
def test_residuals_carry_what_was_not_sent(overlap):
    ranks = h.values(h.launch(h.telescoping, 2, 2, 4, overlap))
    for r in ranks:
        assert r["gap"] < 1e-5, r
        assert r["residual_norm"] > 0.05 * r["delta_norm"]  # the residual does hold back something
        k = max(1, round(0.05 * r["numel"]))
        assert all(0 < n <= 2 * k for n in r["sent_entries"]), r["sent_entries"]


@pytest.mark.parametrize(("name", "options", "fragments", "sync_every", "stop", "end", "overlap", "pending"), [
    ("int8", {"seed": 11}, 1, 3, 5, 10, 0, 0),
    ("stc", {"density": 0.1}, 2, 3, 5, 10, 0, 0),
    # overlap: an exchange is in flight at the checkpoint (begun at step 3, lands at 5; begun at 6, lands at 7)
    ("int8", {"seed": 11}, 1, 3, 4, 10, 2, 1),
    ("stc", {"density": 0.1}, 2, 4, 6, 12, 1, 1),
])
def test_checkpoint_resumes_to_the_same_next_outer_step(name, options, fragments, sync_every, stop, end, overlap,
                                                        pending):
    ranks = h.values(h.launch(h.checkpoint_resume, 2, name, options, sync_every, fragments, stop, end, overlap))
    for r in ranks:
        assert r["equal"] and r["moved"], r
        assert r["outer_steps"][0] == r["outer_steps"][1] and r["sent"][0] == r["sent"][1]
        assert r["pending"] == pending
        assert "sync_every" in r["refused"][0] and "overlap_steps" in r["refused"][1], r["refused"]


@pytest.mark.parametrize("overlap", [0, 1])
def test_non_finite_pseudo_gradient_raises_on_every_rank_naming_the_codec(overlap):
    for r in h.values(h.launch(h.nan_pseudo_gradient, 2, overlap)):
        assert "'int8'" in r["message"] and "rank(s) [1]" in r["message"], r
        assert r["step"] == 2 + overlap  # where the update would have landed
        assert ("begun at inner step 2" in r["message"]) == bool(overlap), r


@pytest.mark.parametrize("overlap", [0, 1])
def test_a_dead_worker_is_an_error_on_the_others_not_a_hang(overlap):
    results = h.launch(h.dead_worker, 2, overlap, timeout=90, collective_timeout=20)
    assert results[1] == ("exited", 3)
    status, value = results[0]
    assert status == "ok" and value["raised"] is not None, results[0]
    assert value["seconds"] < 60
    if overlap:  # the exchange begun at step 4 fails in the background; step 5, where it lands, raises
        assert value["raised"] == "RuntimeError" and value["step"] == 5, value
        assert "exchange of fragment 0 begun at inner step 4" in value["message"], value


def test_overlap_ranks_stay_identical_after_every_update():
    # H = 4, F = 4, overlap 3: a fragment begins at every step, three exchanges are in flight at once
    cases = {"none": {}, "stc": {"density": 0.2}}
    for r in h.values(h.launch(h.overlap_identical, 3, cases, 4, 12, 4, 3)):
        for name in cases:
            c = r[name]
            assert c["starts_same"] and c["merged"] and c["params_same"] and c["drifted"], (name, c)
            # fragment f begins at the steps t with t % 4 == (f + 1) % 4 and lands 3 steps later (the
            # last three by flush(), after step 12)
            assert c["begun"] == {0: [1, 5, 9], 1: [2, 6, 10], 2: [3, 7, 11], 3: [4, 8, 12]}, c["begun"]
            assert c["landed"] == [(0, 4), (1, 5), (2, 6), (3, 7), (0, 8), (1, 9), (2, 10), (3, 11), (0, 12),
                                   (1, 12), (2, 12), (3, 12)], c["landed"]
            assert c["in_flight_at_end"] == 3 and c["outer_steps"] == 12


def test_overlap_with_mixing_keeps_that_share_of_the_local_fragment():
    cases = {"int8": {"seed": 4}}
    for r in h.values(h.launch(h.overlap_identical, 2, cases, 4, 9, 2, 2, 0.5)):
        c = r["int8"]
        # outer copies identical; each landed fragment is exactly 0.5 * local + 0.5 * outer copy
        assert c["starts_same"] and c["merged"] and c["drifted"], c
        assert c["landed"] == [(0, 4), (1, 6), (0, 8), (1, 9)], c["landed"]


def _model_and_inner():
    model = h.mlp()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize(("kwargs", "error", "named"), [
    ({"sync_every": 0}, ValueError, "sync_every"),
    ({"sync_every": 2.5}, ValueError, "sync_every"),
    ({"sync_every": "50"}, ValueError, "sync_every"),
    ({"sync_every": True}, ValueError, "sync_every"),
    ({"fragments": 0}, ValueError, "fragments"),
    ({"fragments": 3, "sync_every": 2}, ValueError, "fragments"),
    ({"fragments": 7, "sync_every": 50}, ValueError, "fragments"),  # the MLP has 6 tensors
    ({"overlap_steps": -1}, ValueError, "overlap_steps"),
    ({"overlap_steps": 1.0}, ValueError, "overlap_steps"),
    ({"overlap_steps": 50, "sync_every": 50}, ValueError, "overlap_steps must be < sync_every"),
    ({"overlap_steps": 3, "sync_every": 2, "fragments": 2}, ValueError, "overlap_steps"),
    ({"mixing": 1.0}, ValueError, "mixing"),
    ({"mixing": -0.1}, ValueError, "mixing"),
    ({"mixing": "half"}, ValueError, "mixing"),
    ({"compressor": "zip"}, ValueError, "compressor"),
    ({"compressor": 8}, TypeError, "compressor"),
    ({"compressor": "stc", "density": 2.0}, ValueError, "density"),
    ({"compressor": "stc", "densty": 0.1}, ValueError, "densty"),
    ({"error_feedback": "yes"}, TypeError, "error_feedback"),
    ({"compressor": "powersgd"}, ValueError, "compressor 'powersgd'"),
    ({"compressor": "qsgd", "levels": 2, "error_feedback": True}, ValueError, "error_feedback: qsgd with levels=2"),
    ({"residual_dtype": "int8"}, ValueError, "residual_dtype"),
    ({"buffers": "average"}, ValueError, "buffers"),
    ({"outer_optimizer": 5}, TypeError, "outer_optimizer"),
    ({"process_group": "world"}, TypeError, "process_group"),
])
def test_bad_settings_are_refused_naming_them(kwargs, error, named):
    model, inner = _model_and_inner()
    with pytest.raises(error, match=named):
        DiLoCo(model, inner, **kwargs)


def test_bad_models_and_optimizers_are_refused_naming_them():
    model, inner = _model_and_inner()
    with pytest.raises(TypeError, match="model"):
        DiLoCo(inner, inner)
    with pytest.raises(TypeError, match="inner_optimizer"):
        DiLoCo(model, model)
    with pytest.raises(ValueError, match="inner_optimizer"):
        DiLoCo(model, torch.optim.SGD(h.mlp().parameters(), lr=0.1))
    with pytest.raises(ValueError, match="outer_optimizer"):
        DiLoCo(model, inner, outer_optimizer=torch.optim.SGD(h.mlp().parameters(), lr=0.1))
    stepped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    h.train_step(model, stepped, 0, 0)
    with pytest.raises(ValueError, match="outer_optimizer"):
        DiLoCo(model, inner, outer_optimizer=stepped)
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="model"):
        DiLoCo(frozen, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))


def test_valid_settings_without_init_process_group_say_so():
    model, inner = _model_and_inner()
    with pytest.raises(RuntimeError, match="init_process_group"):
        DiLoCo(model, inner, compressor="int8", sync_every=50,
               outer_optimizer=functools.partial(torch.optim.SGD, lr=0.5))


def test_fragments_split_parameters_contiguously():
    from fedcomp.distributed.outer import split_fragments

    assert split_fragments([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert split_fragments([100, 1, 1, 1], 3) == [[0], [1], [2, 3]]
    assert split_fragments([1, 1, 1, 100], 3) == [[0, 1], [2], [3]]
    assert split_fragments([0, 0, 0], 2) == [[0], [1, 2]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL)")
def test_nccl_on_cuda_ranks_stay_bit_identical():
    world = min(2, torch.cuda.device_count())
    cases = {"none": {}, "int8": {"seed": 2}, "stc": {"density": 0.1}, "sign": {}}
    ranks = h.values(h.launch(h.identical_after_outer_steps, world, cases, 3, 9, 1, "cuda", backend="nccl"))
    for name in cases:
        for r in ranks:
            assert r[name]["identical"] and r[name]["checks"] == 3, (name, r[name])


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [0, 2])
def test_example_runs_under_torchrun(tmp_path, overlap):
    metrics = tmp_path / "metrics.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(h.free_port()), str(REPO / "examples" / "diloco" / "train.py"), "--task", "digits",
           "--compressor", "int8", "--sync-every", "5", "--outer-steps", "4", "--overlap-steps", str(overlap),
           "--metrics", str(metrics)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(metrics.read_text())
    assert data["world_size"] == 2 and len(data["outer_steps"]) == 4 and data["overlap_steps"] == overlap
    # with overlap the outer updates land 2 steps after each interval, the last one by flush() after step 20
    assert [row["inner_step"] for row in data["outer_steps"]] == ([5, 10, 15, 20] if not overlap else [7, 12, 17, 20])
    last = data["outer_steps"][-1]
    assert last["ratio_vs_ddp"] > 5 and last["mb_sent"] > 0
    assert proc.stdout.count("outer step") >= 4


@pytest.mark.slow
def test_benchmark_quick_mode_writes_its_json(tmp_path):
    out = tmp_path / "diloco.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "diloco.py"), "--quick", "--out", str(out)],
                          check=False, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [row["name"] for row in data["runs"]] == ["ddp", "diloco-fp32", "diloco-stc"]
    assert all(row["final_loss"] > 0 and row["bytes_per_worker"] > 0 for row in data["runs"])
    assert data["runs"][2]["ratio_vs_ddp"] > 100 and data["runs"][2]["error_feedback"]


@pytest.mark.slow
def test_overlap_benchmark_quick_mode_writes_its_json(tmp_path):
    data = json.loads(run_quick("diloco_overlap.py", tmp_path / "overlap.json", timeout=600))
    assert [(r["name"], r["fragments"], r["overlap_steps"]) for r in data["runs"]] == [
        ("streaming", 2, 0), ("streaming-overlap", 2, 2)]
    for r in data["runs"]:
        assert 0 < r["utilisation"] <= 1 and r["final_loss"] > 0 and r["bytes_per_worker"] > 0
        # the exchanges crossed the shaped link: each worker's uplink passed at least half the bytes it sent
        # (the allreduce of 2 ranks sends each its half of the sum)
        for run in r["repeats"]:
            assert min(run["wire_bytes"]["up-0"], run["wire_bytes"]["up-1"]) >= r["bytes_per_worker"] // 2
    assert data["runs"][0]["bytes_per_worker"] == data["runs"][1]["bytes_per_worker"]
    assert len(data["table"]["rows"]) == 2
