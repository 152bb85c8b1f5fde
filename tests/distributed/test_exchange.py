"""fedcomp.distributed.exchange on three gloo ranks: payloads of any length in rank order, the mean by
allreduce and by all-gather (bit-identical on every rank), byte counts, and a failing rank that makes every
rank raise instead of leaving the others waiting."""

from __future__ import annotations

import torch

import fedcomp.compression as fc
from fedcomp.distributed import ByteCount, CompressionError, allgather_bytes, average
from tests.distributed.ranks import run_ranks, values


def _tensor(rank: int, n: int = 3000) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(rank))


def _exchange(rank, world):
    out = {}
    payloads, sent = allgather_bytes(bytes([rank]) * (7 * rank), device="cpu")
    out["gathered"] = (payloads, sent)

    everyone = [_tensor(r) for r in range(world)]
    for name in ("none", "fp16"):
        count = ByteCount()
        mean = average(_tensor(rank), fc.get_compressor(name), None, count=count)
        out[name] = (float((mean - sum(everyone) / world).abs().max()), count.sent, count.dense)

    stc = fc.get_compressor("stc", density=0.02)
    count = ByteCount()
    mean = average(_tensor(rank).reshape(60, 50), stc, fc.ErrorFeedback(stc), count=count)
    expected = sum(fc.decompress(stc.compress(t.reshape(60, 50))) for t in everyone) / world
    gathered = [torch.empty_like(mean) for _ in range(world)]
    torch.distributed.all_gather(gathered, mean)
    out["stc"] = (torch.equal(mean, expected), all(torch.equal(g, mean) for g in gathered), mean.shape,
                  count.sent, count.dense)

    bad = _tensor(rank)
    if rank == 2:
        bad[5] = float("nan")
    for name in ("stc", "none"):
        try:
            average(bad, fc.get_compressor(name, **({"density": 0.02} if name == "stc" else {})), None)
            out[f"nan-{name}"] = "no error"
        except CompressionError as err:
            out[f"nan-{name}"] = (str(err), err.ranks)
    # the group still works after a failure
    out["after"] = float(average(torch.ones(4), fc.get_compressor("none"), None)[0])
    return out


def test_exchange_on_three_ranks():
    res = values(run_ranks(_exchange, 3))
    for rank, r in enumerate(res):
        payloads, sent = r["gathered"]
        assert payloads == [b"", bytes([1]) * 7, bytes([2]) * 14] and sent == 8 + 14
        assert r["none"][0] <= 1e-6 and r["none"][1:] == (3000 * 4, 3000 * 4)
        assert r["fp16"][0] <= 2e-3 and r["fp16"][1:] == (3000 * 2, 3000 * 4)
        exact, identical, shape, sent, dense = r["stc"]
        assert exact and identical and shape == (60, 50) and dense == 12000 and 8 < sent < 12000 / 20
        msg, ranks = r["nan-stc"]
        assert ranks == [2] and "rank 2" in msg and "stc" in msg and "non-finite" in msg, msg
        msg, ranks = r["nan-none"]
        assert ranks == [] and "NaN/Inf" in msg, msg
        assert r["after"] == 1.0
