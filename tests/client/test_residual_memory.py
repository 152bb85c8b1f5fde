"""``residual-dtype = "fp16"`` halves the memory of the error-feedback residual a client holds
between rounds: exactly 2 bytes per float entry instead of 4 (the residual kept in context.state and
the ``residual-bytes`` the client reports), for whole-model and per-tensor codecs."""

import numpy as np
import pytest

from fedcomp.client import compression_mod
from fedcomp.protocol.messages import RESIDUAL_STATE_KEY
from tests.messages import make_ctx, reply_with, train_msg

SHAPES = {"conv.weight": (8, 3, 3, 3), "bn.weight": (8,), "bn.bias": (8,), "bn.running_mean": (8,),
          "fc.weight": (10, 72), "fc.bias": (10,)}
FLOATS = sum(int(np.prod(s)) for s in SHAPES.values())  # 216 + 8*3 + 720 + 10 = 970


def _weights(seed):
    rng = np.random.default_rng(seed)
    w = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    w["bn.num_batches_tracked"] = np.array(seed, np.int64)
    return w


@pytest.mark.parametrize("codec", [{"compressor": "stc", "density": 0.1}, {"compressor": "sign"},
                                   {"compressor": "topk", "density": 0.05}])
def test_fp16_residual_is_exactly_half_of_fp32(codec):
    held = {}
    for dtype in ("fp32", "fp16"):
        ctx = make_ctx(node_id=5)
        for rnd in (1, 2):
            msg = train_msg(_weights(0), {**codec, "server-round": rnd, "residual-dtype": dtype}, dst=5)
            trained = _weights(rnd)
            reply = compression_mod(msg, ctx, lambda m, c, w=trained: reply_with(m, w, n=10))
            assert not reply.has_error(), reply.error
        state = ctx.state[RESIDUAL_STATE_KEY]
        held[dtype] = (sum(a.numpy().nbytes for a in state.values()), float(reply.content["metrics"]["residual-bytes"]),
                       {a.numpy().dtype for a in state.values()})
    assert held["fp32"] == (4 * FLOATS, 4.0 * FLOATS, {np.dtype(np.float32)})
    assert held["fp16"] == (2 * FLOATS, 2.0 * FLOATS, {np.dtype(np.float16)})
