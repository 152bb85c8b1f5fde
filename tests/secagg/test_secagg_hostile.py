"""Hostile clients and operator mistakes on the SecAgg+ path (review of 2026-12-01)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from flwr.common import ndarray_to_bytes
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

from fedcomp.secagg.client import pack_masked
from tests.secagg import helpers


def _tampering_grid(fn, victim=4):
    class G(helpers.RecordingGrid):
        def send_and_receive(self, messages, *, timeout=None):
            out = list(super().send_and_receive(messages, timeout=timeout))
            pid = {nid: c.node_config["partition-id"] for nid, c in self.contexts.items()}
            for r in out:
                rec = r.content.config_records.get(RECORD_KEY_CONFIGS, {}) if not r.has_error() else {}
                if Key.MASKED_PARAMETERS in rec and pid[r.metadata.src_node_id] == victim:
                    rec[Key.MASKED_PARAMETERS] = fn(list(rec[Key.MASKED_PARAMETERS]))
            return out
    return G


class _Pickled:
    pass


def _pickled_npy(n: int) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.array([_Pickled()] * n, dtype=object), allow_pickle=True)
    return buf.getvalue()


@pytest.mark.parametrize("fn", [
    lambda bl: [bl[0]],                                                    # one blob instead of two
    lambda bl: [bl[0], ndarray_to_bytes(np.zeros(7, np.int64))],           # well-formed npy, wrong length
    lambda bl: [bl[0], ndarray_to_bytes(np.zeros(1025, np.float64))],      # float masked vector
    lambda bl: [bl[0], b"hello"],                                          # not npy, not packed
    lambda bl: [bl[0], ndarray_to_bytes(np.full(1025, -1, np.int64))],     # right shape, values out of range
    lambda bl: [bl[0], _pickled_npy(1025)],  # pickled objects
    lambda bl: [bl[0], pack_masked(np.zeros(1, np.int64), bl[1][5])],      # packed, wrong shape
], ids=["one-blob", "npy-wrong-length", "float64", "not-npy", "out-of-range", "pickle", "packed-wrong-shape"])
def test_secagg_malformed_masked_vector_is_a_dropout_not_a_crash(monkeypatch, fn):
    monkeypatch.setattr(helpers, "RecordingGrid", _tampering_grid(fn))
    new, strategy, workflow, _ = helpers.run_round(5, 0.5)
    assert strategy.history[1]["num-replies"] == 4
    assert workflow.round_bytes["malformed-replies"] == 1
    assert all(np.isfinite(v).all() for v in new.values())
