"""fedcomp's DDP communication hook on gloo ranks (CPU): equivalence with torch's hooks, bit-identical
replicas for every codec, the residual, no_sync, checkpoints, errors; NCCL where a GPU is present."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from fedcomp.distributed import CompressionState, compression_hook
from tests.distributed.ranks import SMALL_BUCKET_MB, batch, flat_params, make_model, run_ranks, train, values

#: every codec the hook is tested with, and its options
CODECS = {"sign": {}, "stc": {"density": 0.05}, "topk": {"density": 0.05}, "randomk": {"density": 0.05},
          "qsgd": {}, "int8": {}, "eden": {}, "powersgd": {"rank": 2}, "fp16": {}, "bf16": {}}


def _ddp(model: nn.Module, state=None, hook=compression_hook, bucket_mb: float = 25.0) -> DDP:
    ddp = DDP(model, bucket_cap_mb=bucket_mb)
    if state is not None:
        ddp.register_comm_hook(state, hook)
    return ddp


def _n_buckets(ddp: DDP) -> int:
    return len(ddp.reducer._get_zeros_like_grad_buckets())  # test-only introspection


# -- settings ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, named", [
    ({"compressor": "stcc"}, "compressor"),
    ({"compressor": "stc", "density": 0.0}, "density"),
    ({"compressor": "stc", "densty": 0.1}, "densty"),
    ({"compressor": "qsgd", "levels": 0}, "levels"),
    ({"warmup_steps": -1}, "warmup_steps"),
    ({"warmup_steps": 1.5}, "warmup_steps"),
    ({"min_compression_numel": -3}, "min_compression_numel"),
    ({"nonfinite": "ignore"}, "nonfinite"),
    ({"seed": -1}, "seed"),
    ({"error_feedback": "yes"}, "error_feedback"),
    ({"compressor": "powersgd", "error_feedback": False}, "error_feedback"),
    ({"compressor": "qsgd", "levels": 3, "error_feedback": True}, "error_feedback: qsgd with levels=3"),
])
def test_bad_settings_are_refused_naming_the_argument(kwargs, named):
    with pytest.raises(ValueError, match=named):
        CompressionState(**kwargs)


def test_error_feedback_defaults_off_for_dense_casts_only():
    assert not CompressionState(compressor="none").error_feedback
    assert not CompressionState(compressor="fp16").error_feedback
    assert CompressionState(compressor="stc", density=0.01).error_feedback
    assert CompressionState(compressor="int8").error_feedback
    assert CompressionState(compressor="qsgd").error_feedback  # 15 levels over 512 entries: it converges
    # unbiased codecs with which it would diverge: off by default (explicitly on is refused)
    assert not CompressionState(compressor="qsgd", levels=3).error_feedback
    assert not CompressionState(compressor="atomo").error_feedback
    assert not CompressionState(compressor="randomk", density=0.01, rescale=True).error_feedback


# -- equivalence with DDP's allreduce and torch's fp16 hook -----------------------------------------------


def _equivalence(rank, world):
    out = {}
    for bucket_mb in (25.0, SMALL_BUCKET_MB):
        runs = {}
        for name in ("ddp", "none", "torch_fp16", "fp16"):
            ddp = _ddp(make_model(), bucket_mb=bucket_mb)
            if name == "torch_fp16":
                ddp.register_comm_hook(None, fp16_compress_hook)
            elif name != "ddp":
                ddp.register_comm_hook(CompressionState(compressor=name), compression_hook)
            train(ddp, rank, 6)
            runs[name] = flat_params(ddp.module)
            out[f"buckets@{bucket_mb}"] = _n_buckets(ddp)
        out[bucket_mb] = (float((runs["ddp"] - runs["none"]).abs().max()),
                          float((runs["torch_fp16"] - runs["fp16"]).abs().max()))
    return out


def test_none_equals_ddp_allreduce_and_fp16_equals_torch_fp16_hook():
    for res in values(run_ranks(_equivalence, 2)):
        assert res[f"buckets@{SMALL_BUCKET_MB}"] >= 3  # several buckets, collectives in order
        for bucket_mb in (25.0, SMALL_BUCKET_MB):
            none_diff, fp16_diff = res[bucket_mb]
            assert none_diff <= 1e-6, bucket_mb
            assert fp16_diff == 0.0, bucket_mb


# -- every codec keeps the replicas bit-identical --------------------------------------------------------

STEPS = 20


def _replicas(rank, world, codecs, steps):
    out = {}
    for name, opts in codecs.items():
        state = CompressionState(compressor=name, min_compression_numel=0, **opts)
        ddp = _ddp(make_model(), state, bucket_mb=SMALL_BUCKET_MB)
        train(ddp, rank, steps)
        params = torch.cat([t.detach().reshape(-1) for t in ddp.module.parameters()])  # BN statistics are per rank
        gathered = [torch.empty_like(params) for _ in range(world)]
        dist.all_gather(gathered, params)
        out[name] = {"identical": all(torch.equal(g, params) for g in gathered),
                     "finite": bool(torch.isfinite(params).all()), "step": state.step,
                     "ratio": state.bytes.ratio, "buckets": _n_buckets(ddp)}
    return out


def test_every_codec_keeps_the_replicas_bit_identical():
    res = values(run_ranks(_replicas, 2, CODECS, STEPS, timeout=150))
    for name in CODECS:
        got = res[0][name]
        assert got["identical"] and got["finite"] and got["step"] == STEPS, (name, got)
        assert got["buckets"] >= 3
        if name not in ("fp16", "bf16"):
            assert got["ratio"] > 2.5, (name, got)


def test_three_ranks_stay_bit_identical():
    subset = {k: CODECS[k] for k in ("stc", "qsgd", "powersgd")} | {"none": {}}
    res = values(run_ranks(_replicas, 3, subset, 8, timeout=120))
    for name in subset:
        assert all(r[name]["identical"] for r in res), name


@pytest.mark.slow
def test_every_codec_bit_identical_after_200_steps():
    res = values(run_ranks(_replicas, 2, CODECS, 200, timeout=560, collective_timeout=120))
    assert all(res[0][name]["identical"] and res[0][name]["finite"] for name in CODECS)


# -- gradients in fp16 / bf16 --------------------------------------------------------------------------


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 48), nn.LayerNorm(48), nn.ReLU(), nn.Linear(48, 10))

    def forward(self, x):
        return self.net(x)


def _half(rank, world):
    out = {}
    for dtype in (torch.float16, torch.bfloat16):
        for name in ("stc", "none", "int8"):
            torch.manual_seed(0)
            model = _MLP().to(dtype)
            state = CompressionState(compressor=name, min_compression_numel=0,
                                     **({"density": 0.1} if name == "stc" else {}))
            ddp = _ddp(model, state)
            train(ddp, rank, 8, dtype=dtype, lr=0.01)
            p = torch.cat([t.detach().reshape(-1) for t in ddp.module.parameters()])
            g = [torch.empty_like(p) for _ in range(world)]
            dist.all_gather(g, p)
            out[(str(dtype), name)] = (all(torch.equal(x, p) for x in g), bool(torch.isfinite(p).all()),
                                      next(ddp.module.parameters()).dtype == dtype)
    return out


def test_fp16_and_bf16_gradients():
    for res in values(run_ranks(_half, 2)):
        assert all(all(v) for v in res.values()), res


# -- the residual holds exactly what was not sent ---------------------------------------------------


TELESCOPING = {"stc": {"density": 0.05}, "sign": {}, "qsgd": {}}


def _telescoping(rank, world):
    return {name: _telescoping_one(name, opts) for name, opts in TELESCOPING.items()}


def _telescoping_one(name, opts):
    seen = []

    def recording(state, bucket):
        x = bucket.buffer().clone()
        before = state.residual(bucket.index())
        before = None if before is None else before.clone()
        compressed = state.compresses(x.numel())
        fut = compression_hook(state, bucket)
        seen.append((bucket.index(), compressed, x, before, fut.value().clone(), state.residual(bucket.index())))
        return fut

    state = CompressionState(compressor=name, min_compression_numel=0, warmup_steps=2, **opts)
    ddp = DDP(make_model(), bucket_cap_mb=SMALL_BUCKET_MB)
    ddp.register_comm_hook(state, recording)
    train(ddp, 0, 8)
    checked = 0
    for index, compressed, x, before, mean, after in seen:
        if not compressed:
            continue
        e_prev = torch.zeros_like(x) if before is None else before
        # world size 1: the mean is this rank's decoded payload, and e <- (x + e) - decoded, to the bit
        if not torch.equal(after, (x + e_prev) - mean):
            return f"bucket {index}: residual != x + e - sent"
        checked += 1
    return checked


def test_residual_holds_exactly_what_was_not_sent():
    [res] = values(run_ranks(_telescoping, 1))
    for name, checked in res.items():
        assert isinstance(checked, int) and checked >= 6 * 3, (name, checked)


# -- no_sync accumulation ------------------------------------------------------------------------------


def _no_sync(rank, world):
    calls = []

    def counting(state, bucket):
        calls.append((state.step, bucket.index()))
        return compression_hook(state, bucket)

    state = CompressionState(compressor="stc", density=0.05, min_compression_numel=0)
    ddp = DDP(make_model(), bucket_cap_mb=SMALL_BUCKET_MB)
    ddp.register_comm_hook(state, counting)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    steps, micro = 4, 3
    for step in range(steps):
        opt.zero_grad()
        for m in range(micro):
            x, y = batch(rank, step * micro + m)
            if m < micro - 1:
                with ddp.no_sync():
                    nn.functional.cross_entropy(ddp(x), y).backward()
            else:
                nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return {"calls": calls, "buckets": _n_buckets(ddp), "step": state.step, "steps": steps}


def test_no_sync_accumulation_compresses_once_per_step():
    for res in values(run_ranks(_no_sync, 2)):
        assert res["step"] == res["steps"]
        assert sorted({s for s, _ in res["calls"]}) == list(range(res["steps"]))
        assert len(res["calls"]) == len(set(res["calls"]))  # each bucket once per step
        after_rebuild = [i for s, i in res["calls"] if s >= 1]
        assert len(after_rebuild) == (res["steps"] - 1) * res["buckets"]


# -- a checkpoint of the hook state resumes to the same next step -------------------------------------


RESUMED = {"stc": {"density": 0.05}, "randomk": {"density": 0.05}, "powersgd": {"rank": 2}}


def _resume(rank, world):
    return {name: _resume_one(rank, name, opts) for name, opts in RESUMED.items()}


def _resume_one(rank, name, opts, min_numel=0):
    def fresh():
        state = CompressionState(compressor=name, min_compression_numel=min_numel, **opts)
        return _ddp(make_model(), state, bucket_mb=SMALL_BUCKET_MB), state

    ddp, state = fresh()
    opt = train(ddp, rank, 5)
    saved = copy.deepcopy({"model": ddp.module.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()})
    train(ddp, rank, 2, start=5, opt=opt)
    expected = flat_params(ddp.module)

    ddp2, state2 = fresh()
    ddp2.module.load_state_dict(saved["model"])
    opt2 = torch.optim.SGD(ddp2.parameters(), lr=0.05, momentum=0.9)
    opt2.load_state_dict(saved["opt"])
    state2.load_state_dict(saved["hook"])
    train(ddp2, rank, 2, start=5, opt=opt2)
    return {"equal": torch.equal(flat_params(ddp2.module), expected), "step": state2.step,
            "memory": len(saved["hook"]["memory"])}


def test_a_checkpoint_resumes_to_the_same_next_steps():
    for by_codec in values(run_ranks(_resume, 2)):
        for name, res in by_codec.items():
            assert res["equal"] and res["step"] == 7 and res["memory"] > 0, (name, res)


def _resume_powersgd(rank, world):
    return _resume_one(rank, "powersgd", RESUMED["powersgd"])


def _resume_with_plain_buckets(rank, world):
    # the default min_compression_numel (1024): the small buckets go plain, and the resumed provisional bucket must
    # send them plain too
    return {name: _resume_one(rank, name, RESUMED[name], min_numel=None) for name in ("stc", "powersgd")}


def test_a_checkpoint_resumes_bit_for_bit_where_small_buckets_go_plain():
    for by_codec in values(run_ranks(_resume_with_plain_buckets, 3)):
        for name, res in by_codec.items():
            assert res["equal"] and res["step"] == 7, (name, res)


def test_a_powersgd_checkpoint_resumes_bit_for_bit_on_three_ranks():
    # gloo's ring sums a buffer in an order set by its size: the resumed provisional bucket must be allreduced
    # along the saved buckets for the first resumed step to equal the uninterrupted one
    for res in values(run_ranks(_resume_powersgd, 3)):
        assert res["equal"] and res["step"] == 7 and res["memory"] > 0, res


def test_a_state_saved_with_error_feedback_that_diverges_says_why_it_does_not_load():
    saved = CompressionState(compressor="qsgd", levels=3, error_feedback=False).state_dict()
    saved["error_feedback"] = True  # as saved where error feedback was on by default for every lossy codec
    with pytest.raises(ValueError, match="error_feedback is True, this state's False .error feedback diverges"):
        CompressionState(compressor="qsgd", levels=3).load_state_dict(saved)


def test_state_dict_refuses_another_codec():
    saved = CompressionState(compressor="stc", density=0.05).state_dict()
    with pytest.raises(ValueError, match="codec_options"):
        CompressionState(compressor="stc", density=0.01).load_state_dict(saved)
    with pytest.raises(ValueError, match="compressor"):
        CompressionState(compressor="topk", density=0.05).load_state_dict(saved)


# -- errors: a NaN gradient, a dying rank ------------------------------------------------------------


def _nan(rank, world):
    out = {}
    for nonfinite in ("raise", "propagate"):
        try:
            out[nonfinite] = _nan_one(rank, nonfinite)
        except Exception as err:  # noqa: BLE001 - the test reads the message
            out[nonfinite] = f"{type(err).__name__}: {err}"
    return out


def _nan_one(rank, nonfinite):
    state = CompressionState(compressor="stc", density=0.05, min_compression_numel=0, nonfinite=nonfinite)
    ddp = _ddp(make_model(), state, bucket_mb=SMALL_BUCKET_MB)
    train(ddp, rank, 3)
    x, y = batch(rank, 3)
    if rank == 1:
        x[0, 0, 0, 0] = float("nan")
    nn.functional.cross_entropy(ddp(x), y).backward()
    return [bool(torch.isnan(p.grad).all()) for p in ddp.module.parameters()]


def test_a_nan_gradient_raises_on_every_rank_naming_codec_and_bucket_or_propagates():
    for res in values(run_ranks(_nan, 2)):
        err = res["raise"]
        assert isinstance(err, str) and err.startswith("ValueError"), err
        assert "codec 'stc'" in err and "bucket " in err and "rank 1" in err and "non-finite" in err, err
        assert res["propagate"] == [True] * len(res["propagate"])  # every rank: NaN, GradScaler skips


def _dying(rank, world):
    state = CompressionState(compressor="stc", density=0.05, min_compression_numel=0)
    ddp = _ddp(make_model(), state, bucket_mb=SMALL_BUCKET_MB)
    train(ddp, rank, 3)
    if rank == world - 1:
        os._exit(3)
    train(ddp, rank, 3, start=3)
    return "finished"


def test_a_dying_rank_makes_the_others_fail_not_hang():
    res = run_ranks(_dying, 3, timeout=60, collective_timeout=20)
    assert res[2]["exitcode"] == 3
    for r in res[:2]:
        assert not r.get("hung") and "error" in r, r


# -- NCCL --------------------------------------------------------------------------------------------


def _nccl(rank, world):
    torch.cuda.set_device(rank)
    dist.destroy_process_group()
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{os.environ['FEDCOMP_TEST_PORT']}",
                            rank=rank, world_size=world)
    out = {}
    for name, opts in {"stc": {"density": 0.05}, "none": {}, "fp16": {}, "int8": {}}.items():
        torch.manual_seed(0)
        model = make_model().cuda(rank)
        ddp = DDP(model, device_ids=[rank], bucket_cap_mb=SMALL_BUCKET_MB)
        ddp.register_comm_hook(CompressionState(compressor=name, min_compression_numel=0, **opts), compression_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for step in range(10):
            x, y = batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x.cuda(rank)), y.cuda(rank)).backward()
            opt.step()
        p = torch.cat([t.detach().reshape(-1) for t in ddp.module.parameters()])
        g = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(g, p)
        out[name] = all(torch.equal(x, p) for x in g)
    return out


@pytest.mark.skipif(torch.cuda.device_count() < 1 or not dist.is_nccl_available(), reason="needs a GPU and NCCL")
def test_nccl_ranks_stay_bit_identical(monkeypatch):
    from tests.distributed.ranks import free_port

    monkeypatch.setenv("FEDCOMP_TEST_PORT", str(free_port()))
    world = min(2, torch.cuda.device_count())
    for res in values(run_ranks(_nccl, world, timeout=180)):
        assert all(res.values()), res
