"""PowerSGD in the DDP hook through two allreduces (of P and of Q) per bucket: the bytes, independent of the
world size; the mean identical on every rank; each rank's residual holding exactly what was not sent; a
low-rank gradient recovered; NaN named on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fedcomp.distributed import CompressionState
from fedcomp.distributed.exchange import CompressionError
from fedcomp.distributed.lowrank import powersgd_allreduce
from tests.distributed.ranks import run_ranks, values

SHAPES = [(20, 30), (5,), (8, 3, 3, 3)]
KEYS = ["0.0", "0.1", "0.2"]


def _grads(rank: int, step: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return [torch.randn(*s, generator=gen) for s in SHAPES]


def _same_on_every_rank(t: torch.Tensor) -> bool:
    got = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(got, t)
    return all(torch.equal(g, t) for g in got)


def _steps(rank, world, value_dtype):
    state = CompressionState(compressor="powersgd", rank=2, value_dtype=value_dtype, min_compression_numel=0)
    out = {"identical": [], "telescopes": [], "bytes": []}
    carried = [torch.zeros(s) for s in SHAPES]  # what this rank has not sent yet
    for step in range(3):
        grads = _grads(rank, step)
        before = state.bytes.sent
        mean = powersgd_allreduce(state, grads, KEYS, None, state.bytes)
        out["bytes"].append(state.bytes.sent - before)
        out["identical"].append(_same_on_every_rank(mean))
        pieces = mean.split([g.numel() for g in grads])
        for i in (0, 2):  # approx + new residual == gradient + old residual, to float32 rounding
            want = grads[i] + carried[i]
            res = state.tensor_feedback(KEYS[i]).residual
            out["telescopes"].append(float((pieces[i].reshape(want.shape) + res - want).abs().max()))
            carried[i] = res.clone()
        mean_small = sum(g[1] for g in (_grads(r, step) for r in range(world))) / world
        out.setdefault("small", []).append(float((pieces[1] - mean_small).abs().max()))
    out["memory"] = sorted(state.state_dict()["memory"]["0.0"])
    return out


def test_two_allreduces_per_bucket_the_same_bytes_at_any_world_size():
    p_and_small, q = 20 * 2 + 8 * 2 + 5, 30 * 2 + 27 * 2  # P of each matrix, the vector; Q of each matrix
    for world in (2, 3):
        for res in values(run_ranks(_steps, world, "fp32")):
            assert res["bytes"] == [4 * (p_and_small + q)] * 3
            assert all(res["identical"])
            assert max(res["telescopes"]) < 1e-5 and max(res["small"]) < 1e-6
            assert res["memory"] == ["powersgd/q", "residual"]
    for res in values(run_ranks(_steps, 2, "fp16")):
        # fp16 factors; the vector exact, in fp32, by an allreduce of its own (it has no error feedback)
        assert res["bytes"] == [2 * (p_and_small - 5 + q) + 4 * 5] * 3 and all(res["identical"])
        assert max(res["small"]) < 1e-6


def _rank_one(rank, world):
    u = torch.randn(20, 1, generator=torch.Generator().manual_seed(1))
    state = CompressionState(compressor="powersgd", rank=2, min_compression_numel=0)
    g = (u @ torch.ones(1, 30)) * (rank + 1)  # every rank's gradient in the same rank-1 space
    mean = powersgd_allreduce(state, [g], ["0.0"], None, state.bytes)
    want = u @ torch.ones(1, 30) * (world + 1) / 2
    return float((mean.reshape(20, 30) - want).abs().max() / want.abs().max())


def test_a_rank_one_mean_gradient_is_recovered_in_one_step():
    assert max(values(run_ranks(_rank_one, 2))) < 1e-5


def _nan(rank, world):
    state = CompressionState(compressor="powersgd", rank=2, min_compression_numel=0)
    grads = _grads(rank)
    if rank == 1:
        grads[0][3, 4] = float("nan")
    try:
        powersgd_allreduce(state, grads, KEYS, None, state.bytes)
    except CompressionError as err:
        return str(err)
    return "no error"


def test_a_nan_gradient_raises_on_every_rank():
    for msg in values(run_ranks(_nan, 2)):
        assert msg.startswith("powersgd:") and "NaN/Inf" in msg, msg


def _large(rank, world):
    state = CompressionState(compressor="powersgd", rank=2, value_dtype="fp16", min_compression_numel=0)
    gen = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(4):
        g = 300 * torch.randn(64, 64, generator=gen)  # every entry fits fp16; M Q with Q ~ M would not
        out.append(bool(torch.isfinite(powersgd_allreduce(state, [g], ["0.0"], None, state.bytes)).all()))
    return out


def test_fp16_factors_of_large_gradients_stay_finite_step_after_step():
    """Found by an attack round: the warm-start Q is as large as M, so P = M Q grew as M squared and passed
    fp16's range from the second step on, every step."""
    assert values(run_ranks(_large, 2)) == [[True] * 4] * 2


def _small_only(rank, world):
    state = CompressionState(compressor="powersgd", rank=2, value_dtype="fp16", min_compression_numel=0)
    g = torch.randn(5, generator=torch.Generator().manual_seed(rank)) * 1e-3  # below fp16's normal range in part
    mean = powersgd_allreduce(state, [g], ["0.0"], None, state.bytes)
    want = sum(torch.randn(5, generator=torch.Generator().manual_seed(r)) * 1e-3 for r in range(world)) / world
    return {"error": float((mean - want).abs().max()), "bytes": state.bytes.sent}


def test_with_fp16_factors_a_bucket_of_small_tensors_goes_exact_in_one_allreduce():
    for res in values(run_ranks(_small_only, 2)):
        assert res["bytes"] == 4 * 5 and res["error"] < 1e-9
